"""The operator's own certificates, without cert-manager: a CA per trust domain, the webhook
and extender serving certificates, the kube-scheduler's extender client certificate.

- :mod:`kvgpu.certs.issue` — pure: make a CA, sign leaf certificates, decide renewal from
  ``notAfter`` (no I/O; the clock is an argument);
- :mod:`kvgpu.certs.secrets` — the adapter: keeps them in Secrets (create or adopt, safe with
  several replicas), patches the webhook configurations' ``caBundle``, writes the files the
  operator's servers read (``kvgpu certs``).
"""
