"""Control: the REST API users drive the platform with (results, health)."""
