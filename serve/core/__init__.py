"""The core: request types and checks, admission, batching, the engine."""
