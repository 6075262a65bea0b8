"""Models gymv can build without a hub: tiny random-initialised VLMs, and loading any policy checkpoint."""
