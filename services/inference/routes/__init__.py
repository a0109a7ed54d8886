"""HTTP routes, one module per resource; the API layer is the only place that speaks HTTP errors."""
