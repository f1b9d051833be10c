"""
The project's layout rules (DESIGN.md §2), checked on the checkout: packaging lists every
package, Twisted can find the plugins, every module has its place in the layers, imports run
one way (down the layers) and in no circle, and no test module imports another.

Imports are read from the source with C{ast}, those inside functions included: a circle
hidden in a function body is a circle all the same.
"""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd import config, settings

ROOT = Path(loopd.__file__).parent.parent

#: What every front door reads into and fails with: the one request model and its errors.
GATEWAY_MODEL = ("loopd.gateway.errors", "loopd.gateway.request")

#: The package's layers, lowest first. A module may import its own layer and the ones below
#: it, never one above. An entry names a module exactly, or with C{.*} a package and
#: everything in it; a module belongs to its most specific entry (C{loopd.gateway.errors}
#: before C{loopd.gateway.*}).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "ground: errors, values, strict parsing, the config files",
        (
            "loopd",
            "loopd.errors",
            "loopd.strict_json",
            "loopd.digest",
            "loopd.runtime_dir",
            "loopd.unixsocket",
            "loopd._message_style",
            "loopd._validate",
            "loopd.settings",
            "loopd.tcp_address",
            "loopd.config",
            "loopd.access_token",
            "loopd.reactor",
        ),
    ),
    ("wire: HTTP over a Unix socket, server-sent events", ("loopd.http", "loopd.sse")),
    (
        "the llama client, the self-test, the forwarder",
        ("loopd.llama.*", "loopd.selftest.*", "loopd.inferproxy"),
    ),
    ("the lease scheduler and its protocol", ("loopd.queue.*",)),
    ("mixture of agents, pure", ("loopd.moa.*",)),
    ("the gateway's one request model and its errors", GATEWAY_MODEL),
    ("the front doors, pure", ("loopd.gateway.doors.*",)),
    ("the gateway", ("loopd.gateway.*",)),
    (
        "the daemon, the terminal chat, status and replay",
        (
            "loopd.service",
            "loopd.tap.*",
            "loopd.chatui",
            "loopd.chatloop",
            "loopd.status_show",
            "loopd.replay",
        ),
    ),
    ("the commands", ("loopd.cli", "loopd.ui_command", "loopd.status_command", "loopd.demo.*")),
    ("the public test kit", ("loopd.testing.*",)),
    ("loopd's own tests", ("loopd.test.*",)),
)


def python_files() -> list[Path]:
    """
    Every Python file of the project: the package, the plugins, the process-level tests and
    the benchmarks.
    """
    files: list[Path] = []
    for folder in ("loopd", "twisted", "test", "bench"):
        files.extend(sorted((ROOT / folder).rglob("*.py")))
    return files


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "loopd").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """
    The package's modules that C{path} imports, anywhere in it: C{from loopd.x import y}
    is an import of C{loopd.x.y} when that is a module, else of C{loopd.x}.
    """
    return imported_from(path.read_text(encoding="utf-8"), path, known)


def imported_from(source: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """L{imported} of C{source}, the text of the file at C{path}."""
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                target = candidate if candidate in known else node.module
                if target in known:
                    yield target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name


def import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (itself excluded)."""
    known = package_modules()
    return {
        name: {target for target in imported(path, known) if target != name}
        for name, path in known.items()
    }


def names(entry: str, module: str) -> bool:
    """Whether a L{LAYERS} entry names C{module}."""
    if entry.endswith(".*"):
        package = entry[: -len(".*")]
        return module == package or module.startswith(package + ".")
    return module == entry


def naming(module: str) -> list[tuple[int, int]]:
    """
    Each L{LAYERS} entry naming C{module}, most specific first: its length without C{.*}
    (a longer entry names fewer modules) and its layer's index.
    """
    found = [
        (len(entry.removesuffix(".*")), index)
        for index, (_, entries) in enumerate(LAYERS)
        for entry in entries
        if names(entry, module)
    ]
    return sorted(found, reverse=True)


def layer_of(module: str) -> int | None:
    """The index in L{LAYERS} of the layer whose most specific entry names C{module}."""
    found = naming(module)
    return found[0][1] if found else None


#: What the front doors may import of the package besides themselves: the request model
#: and its errors, the llama client's values and its rendering of messages, the event
#: stream's framing, strict JSON. Nothing of Twisted, the exchange, the mesh, the upstream
#: call, the sessions or the leases.
DOORS_MAY_IMPORT = frozenset(
    {*GATEWAY_MODEL, "loopd.llama.types", "loopd.llama.request", "loopd.sse", "loopd.strict_json"}
)


def impure_imports(source: str, known: dict[str, Path]) -> list[str]:
    """
    What a front door's C{source} imports that a door may not: any Twisted module, and any
    module of the package outside the doors and L{DOORS_MAY_IMPORT}.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        found += [m for m in modules if m == "twisted" or m.startswith("twisted.")]
    path = Path("<source>")
    found += [
        target
        for target in imported_from(source, path, known)
        if not names("loopd.gateway.doors.*", target) and target not in DOORS_MAY_IMPORT
    ]
    return sorted(set(found))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


class LayoutTests(SynchronousTestCase):
    """
    Rules of the layout that a later change could break without noticing.
    """

    def test_every_package_is_packaged(self) -> None:
        """
        setup.cfg lists exactly the packages under loopd/ plus twisted.plugins (which
        setuptools' find: would miss, having no __init__.py).
        """
        parser = configparser.ConfigParser()
        parser.read(ROOT / "setup.cfg")
        listed = set(parser["options"]["packages"].split())
        present = {
            ".".join(init.parent.relative_to(ROOT).parts)
            for init in (ROOT / "loopd").rglob("__init__.py")
        }
        self.assertEqual(listed, present | {"twisted.plugins"})

    def test_no_init_under_twisted(self) -> None:
        """
        No __init__.py under twisted/: with one, Twisted's plugin scan would skip the folder
        and shadow Twisted itself.
        """
        self.assertEqual(list((ROOT / "twisted").rglob("__init__.py")), [])

    def test_every_module_has_a_layer(self) -> None:
        """A new module must be given its place in L{LAYERS}, and only one."""
        unplaced = [name for name in package_modules() if layer_of(name) is None]
        self.assertEqual(unplaced, [])
        twice = [
            name
            for name in package_modules()
            if len(found := naming(name)) > 1 and found[0][0] == found[1][0]
        ]
        self.assertEqual(twice, [])
        self.assertIsNone(layer_of("loopd.unheard_of"))

    def test_no_upward_import(self) -> None:
        """No module imports a module of a higher layer."""
        upward = sorted(
            f"{module} -> {target}"
            for module, targets in import_graph().items()
            for target in targets
            if (here := layer_of(module)) is not None
            and (there := layer_of(target)) is not None
            and there > here
        )
        self.assertEqual(upward, [])

    def test_doors_are_pure(self) -> None:
        """
        The front doors (L{loopd.gateway.doors}) import no Twisted and nothing of the
        package but each other and L{DOORS_MAY_IMPORT}: a door is a reader and a writer,
        and the exchange is the same for every door.
        """
        known = package_modules()
        doors = [path for name, path in known.items() if names("loopd.gateway.doors.*", name)]
        self.assertIn("loopd.gateway.doors.chat", known)
        offenders = {
            str(path.relative_to(ROOT)): found
            for path in doors
            if (found := impure_imports(path.read_text(encoding="utf-8"), known))
        }
        self.assertEqual(offenders, {})

    def test_impure_imports_found(self) -> None:
        """The doors rule sees Twisted and the exchange, anywhere in a module (it can fail)."""
        known = package_modules()
        source = (
            "from twisted.internet import defer\n"
            "import twisted.web.server\n"
            "def f():\n"
            "    from loopd.gateway.exchange import DoorRoute\n"
            "from loopd.gateway.request import GatewayRequest\n"
            "from loopd.gateway.doors.fields import Fields\n"
        )
        self.assertEqual(
            impure_imports(source, known),
            ["loopd.gateway.exchange", "twisted.internet", "twisted.web.server"],
        )

    def test_no_import_circle(self) -> None:
        """No modules import each other, directly or around a circle, at any depth."""
        self.assertEqual(circles(import_graph()), [])

    def test_circle_detection(self) -> None:
        """The circle finder finds a circle and no false one (so the rule above can fail)."""
        self.assertEqual(
            circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]]
        )
        self.assertEqual(circles({"a": {"b"}, "b": set()}), [])

    def test_test_case_names_exist(self) -> None:
        """Every C{test-case-name} a module declares names a test module that exists."""
        missing = []
        for path in python_files():
            first = path.read_text(encoding="utf-8").split("\n", 1)[0]
            if "test-case-name:" not in first:
                continue
            listed = first.split("test-case-name:", 1)[1].replace("-*-", "").split(",")
            for name in (part.strip() for part in listed):
                if not (ROOT / (name.replace(".", "/") + ".py")).exists():
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
        self.assertEqual(missing, [])

    def test_no_test_imports_a_test(self) -> None:
        """Shared test helpers live in test support or loopd.testing, never in a test module."""
        offenders = []
        for path in python_files():
            if not path.name.startswith("test_"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                    if any(part.startswith("test_") for name in names for part in name.split(".")):
                        offenders.append(f"{path.relative_to(ROOT)}: {node.module}")
        self.assertEqual(offenders, [])

    def test_one_import_path_for_the_config_values(self) -> None:
        """
        The config's values (L{loopd.settings}: C{Config}, C{Endpoint}, ...) are imported
        from C{loopd.settings} only; C{loopd.config} is the parser and exports none of them.
        """
        values = set(settings.__all__)
        self.assertEqual(values & set(config.__all__), set())
        offenders = []
        for path in python_files():
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "loopd.config":
                    offenders += [
                        f"{path.relative_to(ROOT)}: {alias.name}"
                        for alias in node.names
                        if alias.name in values
                    ]
        self.assertEqual(offenders, [])
