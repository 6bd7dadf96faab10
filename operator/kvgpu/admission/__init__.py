"""Admission webhooks for pods: mutate (schedulerName, shim injection) and validate (requests,
reserved env vars, allocation annotations). Decisions are pure functions in :mod:`.mutate` and
:mod:`.validate`; :mod:`.handlers` wires them into Kopf; :mod:`.config` builds our webhook
configurations."""
