"""PLACEHOLDER: being written; replaced by the real module."""
