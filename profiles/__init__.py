"""Bundled data: model profiles (models/*.yaml) and GPU profiles (gpus/*.yaml), each figure with its source."""
