"""The DLRM job: config, data sources, model builder and the training entry point."""
