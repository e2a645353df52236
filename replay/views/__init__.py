"""What replay prints: text for people and JSON for machines (pure)."""
