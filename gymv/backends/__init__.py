"""Generation and training backends behind small interfaces, plus the multimodal adapters they share."""
