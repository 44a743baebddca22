"""Models wired to graphattn backends: an embedded tiny decoder and a transformers adapter."""
