"""``kubectl vgpu``: the views (:mod:`.views`, pure) behind :mod:`kvgpu.cli.kubectl_vgpu`."""
