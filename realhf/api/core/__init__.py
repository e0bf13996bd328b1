"""Abstractions only: SequenceSample, MFCDef and the DFG, model/interface/backend registries, generation contract."""
