"""The kube-scheduler extender: filter, prioritize and bind over HTTP (JSON)."""
