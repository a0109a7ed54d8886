"""HTTP routes of the controller, one module per resource."""
