"""Protocol adapters: bytes/messages <-> the core's request and response types."""
