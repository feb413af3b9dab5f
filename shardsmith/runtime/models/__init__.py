"""Model families served by the runtime, and the one registry (``registry``) that says which
architecture builds which model."""
