"""The GPT language-model job: config, model builder and the training entry point."""
