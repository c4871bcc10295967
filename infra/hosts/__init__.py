"""Hosts on one machine: Linux network namespaces on a bridge (net.py) and the platform laid out
over them (topology.py), for `make test-hosts`."""
