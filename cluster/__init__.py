"""Cluster mode: many daemons, one namespace kept in Redis, one store."""
