"""``kvgpu certs``: issue, adopt and rotate kvgpu's certificates in Secrets without cert-manager
(:mod:`kvgpu.certs`). The chart runs it in the operator pod as an init container (``--once``:
the operator's certificate files exist before it starts) and as a sidecar (every
``--interval`` seconds: rotation well before ``notAfter``, the webhook ``caBundle`` kept set).
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("certs")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None,
              help="kubeconfig file; default: the in-cluster service account")
@click.option("--namespace", envvar="POD_NAMESPACE", default="kvgpu-system", show_default=True,
              help="namespace of the Secrets and Services (env POD_NAMESPACE)")
@click.option("--webhook-service", default="kvgpu-webhook", show_default=True,
              help="Service the API server calls for admission (the serving certificate's DNS names)")
@click.option("--extender-service", default="kvgpu-operator", show_default=True,
              help="Service kube-scheduler calls for the extender (its serving certificate's DNS names)")
@click.option("--scheduler-client", default="kvgpu-scheduler", show_default=True,
              help="CN of kube-scheduler's extender client certificate (= --extender-allowed-clients)")
@click.option("--webhook-san", "webhook_sans", multiple=True,
              help="a further DNS name or IP address of the webhook serving certificate (repeatable)")
@click.option("--extender-san", "extender_sans", multiple=True,
              help="a further DNS name or IP address of the extender serving certificate (repeatable)")
@click.option("--mutating", multiple=True, default=("kvgpu-mutate",), show_default=True,
              help="MutatingWebhookConfiguration whose caBundle is set (repeatable)")
@click.option("--validating", multiple=True, default=("kvgpu-validate",), show_default=True,
              help="ValidatingWebhookConfiguration whose caBundle is set (repeatable)")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="write <dir>/<secret>/{tls.crt,tls.key,ca.crt} of the serving certificates here")
@click.option("--interval", type=click.FloatRange(1, 86400), default=3600.0, show_default=True,
              help="seconds between rounds (renewal happens once a third of a lifetime is left)")
@click.option("--once", is_flag=True, help="one round, then exit (non-zero on failure)")
def certs_cmd(kubeconfig: str | None, namespace: str, webhook_service: str, extender_service: str,
              scheduler_client: str, webhook_sans: tuple[str, ...], extender_sans: tuple[str, ...],
              mutating: tuple[str, ...], validating: tuple[str, ...],
              out_dir: Path | None, interval: float, once: bool) -> None:
    """Issue, adopt and rotate the webhook and extender certificates (no cert-manager)."""
    from kvgpu.certs.issue import kvgpu_layout
    from kvgpu.certs.secrets import run
    from kvgpu.kube import connect
    from kvgpu.logs import configure_logging
    from kvgpu.procs import run_loop

    configure_logging()
    try:
        layout = kvgpu_layout(namespace, webhook_service, extender_service, scheduler_client,
                              webhook_sans, extender_sans)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--webhook-san/--extender-san") from None

    async def main() -> None:
        api = await connect(kubeconfig)
        try:
            await run(api, namespace, layout, interval=interval, once=once, webhook_ca_secret="kvgpu-ca",
                      mutating=mutating, validating=validating, out_dir=out_dir)
        finally:
            await api.close()

    run_loop(main())
