"""Tests for L{loopd.gateway.slot_store}: who each slot holds, which files exist, the plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.slot_store import SlotPlan, SlotStore, filename, restore_worked
from loopd.llama.slot_files import check_filename


def keep_all(session: str) -> bool:
    """Every session is worth saving."""
    return True


class FilenameTests(SynchronousTestCase):
    """A session's file name: safe whatever the session id, one per endpoint and session."""

    @given(st.text(), st.text())
    def test_always_safe(self, endpoint: str, session: str) -> None:
        """Any endpoint and session id, path parts included, give one safe component."""
        name = filename(endpoint, session)
        self.assertEqual(check_filename(name), name)
        self.assertRegex(name, r"^loopd-[0-9a-f]{32}\.bin$")

    def test_distinct(self) -> None:
        """Sessions and endpoints do not share files; the same pair always has the same."""
        self.assertEqual(filename("e", "../../etc/passwd"), filename("e", "../../etc/passwd"))
        names = {filename(e, s) for e, s in (("e", "a"), ("e", "b"), ("f", "a"), ("e\na", ""))}
        self.assertEqual(len(names), 4)


class PlanTests(SynchronousTestCase):
    """What to do on a slot before a session's request."""

    def test_empty_slot_no_file(self) -> None:
        """Nothing known, nothing saved: nothing to do."""
        self.assertEqual(SlotStore().plan("e", 0, "a", keep_all), SlotPlan())

    def test_own_slot(self) -> None:
        """A session back on the slot that holds it: nothing, even with a file."""
        store = SlotStore()
        store.completed("e", 0, "a")
        store.saved("e", 0, "a", 100)
        store.completed("e", 0, "a")
        self.assertEqual(store.plan("e", 0, "a", keep_all), SlotPlan())

    def test_switch_away_saves_the_resident(self) -> None:
        """Another session's conversation in the slot is saved to that session's file."""
        store = SlotStore()
        store.completed("e", 0, "a")
        self.assertEqual(store.plan("e", 0, "b", keep_all), SlotPlan("a", filename("e", "a")))

    def test_return_restores(self) -> None:
        """A session with a file, on a slot holding another: save that one, restore this one."""
        store = SlotStore()
        store.completed("e", 0, "a")
        store.saved("e", 0, "a", 100)
        store.completed("e", 0, "b")
        plan = store.plan("e", 0, "a", keep_all)
        self.assertEqual(plan, SlotPlan("b", filename("e", "b"), filename("e", "a")))
        # On an empty (unknown) slot: only the restore.
        self.assertEqual(store.plan("e", 1, "a", keep_all), SlotPlan(None, None, plan.restore_file))

    def test_clean_resident_not_saved_again(self) -> None:
        """A slot holding a restored or saved conversation that has not run since: no save."""
        store = SlotStore()
        store.completed("e", 0, "a")
        store.saved("e", 0, "a", 100)
        self.assertEqual(store.plan("e", 0, "b", keep_all).save, None)
        store.completed("e", 0, "a")
        self.assertEqual(store.plan("e", 0, "b", keep_all).save, "a")

    def test_restored_resident_saved_again(self) -> None:
        """A restored file is deleted at once, so the slot's conversation is saved anew."""
        store = SlotStore()
        store.saved("e", 0, "a", 100)
        self.assertEqual(store.restored("e", 1, "a"), [("e", filename("e", "a"))])
        self.assertFalse(store.has_file("e", "a"))
        self.assertEqual(store.plan("e", 1, "b", keep_all).save, "a")

    def test_gone_resident_not_saved(self) -> None:
        """A resident the caller no longer keeps (a closed anonymous session): no save."""
        store = SlotStore()
        store.completed("e", 0, "anonymous:1")
        plan = store.plan("e", 0, "b", lambda session: session != "anonymous:1")
        self.assertEqual(plan, SlotPlan())

    def test_per_endpoint(self) -> None:
        """Another endpoint's slots and files are its own."""
        store = SlotStore()
        store.completed("e", 0, "a")
        store.saved("e", 0, "a", 100)
        self.assertEqual(store.plan("f", 0, "a", keep_all), SlotPlan())
        self.assertEqual(store.resident("f", 0), None)
        self.assertFalse(store.has_file("f", "a"))


class OutcomeTests(SynchronousTestCase):
    """Saves and restores that failed or did nothing."""

    def test_save_of_nothing_is_no_file(self) -> None:
        """A save that wrote no tokens leaves no file to restore."""
        store = SlotStore()
        store.saved("e", 0, "a", 0)
        self.assertFalse(store.has_file("e", "a"))

    def test_failed_save_drops_the_file(self) -> None:
        """After a failed save the older file is not restored."""
        store = SlotStore()
        store.saved("e", 0, "a", 10)
        store.save_failed("e", "a")
        self.assertFalse(store.has_file("e", "a"))

    def test_failed_restore(self) -> None:
        """A failed restore drops the file and what the slot holds is unknown."""
        store = SlotStore()
        store.completed("e", 0, "b")
        store.saved("e", 0, "a", 10)
        store.restore_failed("e", 0, "a")
        self.assertFalse(store.has_file("e", "a"))
        self.assertIsNone(store.resident("e", 0))

    def test_restore_worked(self) -> None:
        """A restore worked when the next answer reused more than the threshold."""
        self.assertTrue(restore_worked(2309, 64))
        self.assertFalse(restore_worked(64, 64))
        self.assertFalse(restore_worked(0, 0))

    def test_bounded(self) -> None:
        """Past max_files, the least recently saved session loses its file first."""
        store = SlotStore(max_files=2)
        deleted = [store.saved("e", 0, session, 10) for session in ("a", "b", "a", "c")]
        self.assertEqual([store.has_file("e", s) for s in "abc"], [True, False, True])
        self.assertEqual(deleted, [[], [], [], [("e", filename("e", "b"))]])
        self.assertRaises(ValueError, SlotStore, 0)


class DeletionTests(SynchronousTestCase):
    """Which files the table says to delete, and the byte budget."""

    def test_failures_delete(self) -> None:
        """A failed save or restore, or an empty save: that file goes."""
        store = SlotStore()
        self.assertEqual(store.saved("e", 0, "a", 0, 0), [("e", filename("e", "a"))])
        store.saved("e", 0, "a", 10, 100)
        self.assertEqual(store.save_failed("e", "a"), [("e", filename("e", "a"))])
        store.saved("e", 0, "a", 10, 100)
        self.assertEqual(store.restore_failed("e", 0, "a"), [("e", filename("e", "a"))])
        self.assertEqual(store.kept_bytes("e"), 0)

    def test_forget(self) -> None:
        """A session that is over: its files on every endpoint go, and its slot is not saved."""
        store = SlotStore()
        store.saved("e", 0, "a", 10, 100)
        store.saved("f", 0, "a", 10, 100)
        store.saved("e", 1, "b", 10, 100)
        store.completed("e", 0, "a")
        forgotten = store.forget("a")
        self.assertEqual(sorted(forgotten), [("e", filename("e", "a")), ("f", filename("f", "a"))])
        self.assertEqual((store.kept_files("e"), store.kept_bytes("e")), (1, 100))
        self.assertEqual(store.plan("e", 0, "c", keep_all), SlotPlan())
        self.assertEqual(store.forget("a"), [])

    def test_budget_per_endpoint(self) -> None:
        """An endpoint's files beyond its budget go, oldest first; another's are untouched."""
        store = SlotStore(budgets={"e": 250})
        store.saved("f", 0, "x", 10, 1000)
        store.saved("e", 0, "a", 10, 100)
        store.saved("e", 0, "b", 10, 100)
        self.assertEqual(store.saved("e", 0, "c", 10, 100), [("e", filename("e", "a"))])
        self.assertEqual(store.saved("e", 0, "b", 10, 200), [("e", filename("e", "c"))])
        self.assertEqual((store.kept_files("e"), store.kept_bytes("e")), (1, 200))
        self.assertTrue(store.has_file("f", "x"))

    def test_over_the_budget_alone(self) -> None:
        """A file larger than the budget is not kept, and its slot is not saved again."""
        store = SlotStore(budgets={"e": 50})
        store.completed("e", 0, "a")
        self.assertEqual(store.saved("e", 0, "a", 10, 100), [("e", filename("e", "a"))])
        self.assertEqual(store.kept_bytes("e"), 0)
        self.assertEqual(store.plan("e", 0, "b", keep_all), SlotPlan())

    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["saved", "restored", "restore_failed", "forget"]),
                st.sampled_from(["e", "f"]),
                st.sampled_from("abcd"),
                st.integers(0, 400),
            )
        )
    )
    def test_disk_follows_the_table(self, steps: list[tuple[str, str, str, int]]) -> None:
        """
        Deleting what the table says leaves on disk exactly the files it holds, within
        each endpoint's budget and the count bound, whatever the order of events.
        """
        store = SlotStore(max_files=3, budgets={"e": 500, "f": 300})
        disk: dict[tuple[str, str], int] = {}
        for action, endpoint, session, size in steps:
            name = filename(endpoint, session)
            if action == "saved":
                disk[(endpoint, name)] = size  # the server writes the file
                deleted = store.saved(endpoint, 0, session, 1 if size else 0, size)
            elif action == "restored":
                deleted = store.restored(endpoint, 0, session)
            elif action == "restore_failed":
                deleted = store.restore_failed(endpoint, 0, session)
            else:
                deleted = store.forget(session)
            for gone in deleted:
                disk.pop(gone, None)
            for each in ("e", "f"):
                kept = {n for (e, n) in disk if e == each}
                held = {filename(each, s) for s in "abcd" if store.has_file(each, s)}
                self.assertEqual(kept, held)
                self.assertEqual(
                    sum(v for (e, _), v in disk.items() if e == each), store.kept_bytes(each)
                )
            self.assertLessEqual(store.kept_bytes("e"), 500)
            self.assertLessEqual(store.kept_bytes("f"), 300)
            self.assertLessEqual(len(disk), 3)
