"""Model definitions: our own torch implementations over the packed token layout."""
