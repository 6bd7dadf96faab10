"""The shared contract between kvgpu's components: pure data, no I/O."""
