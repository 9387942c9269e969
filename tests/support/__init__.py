"""Helpers the tests share: factories, admin requests, real OS processes, a private MariaDB server."""
