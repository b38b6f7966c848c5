"""The commands: `distlab` (cli), tour, doctor (with its GPU check), export and cluster (torchrun), build-labs,
and the nbval plugin (nbval_plugin). They sit on top: they may import any layer, and nothing in distlab imports them.
May import: everything in distlab.
"""
