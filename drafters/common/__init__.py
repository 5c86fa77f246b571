"""Neutral pieces shared by every drafter family (layers, masks, losses, vocab maps, metrics)."""
