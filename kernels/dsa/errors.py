"""The one exception family raised by the DSA operators."""


class DSAInputError(ValueError):
    """An argument to a DSA operator has a shape, dtype or value it cannot take."""
