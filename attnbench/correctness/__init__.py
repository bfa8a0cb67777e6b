"""Correctness: the float64 reference, the book's golden values, and the matrix every implementation passes."""
