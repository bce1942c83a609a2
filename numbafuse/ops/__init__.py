"""One module per op family; each holds its Functions and public functions."""
