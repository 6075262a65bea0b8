"""Data: rows in NeMo Gym's format, images as data URLs, dataset generation."""
