"""Task data, prompt templates and quality metrics."""
