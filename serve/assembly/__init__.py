"""Assembly: the server (app) and the load path (loading)."""
