"""SGLang's CPU engine as a test server for the plugin: what the real 0.5.23 server needs on
a machine without a GPU, kept apart from the plugin and never imported by it."""
