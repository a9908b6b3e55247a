"""Readers and generators of training data. No third-party text is bundled: real data is read by path."""
