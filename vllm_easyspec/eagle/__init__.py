"""EAGLE draft heads: model, reference checkpoint formats, data, features, trainer."""
