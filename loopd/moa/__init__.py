"""
Mixture of agents (C{model: "mesh"}): pure pieces of the mesh turn, one module per job.
"""
