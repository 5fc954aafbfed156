"""The backend: ONNX Runtime sessions, the export's graphs, failure injection."""
