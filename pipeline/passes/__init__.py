"""Relax passes: rewrites of the imported module before and around fusion (and the ONNX-node
provenance they carry)."""
