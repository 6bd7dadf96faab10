"""bench/scale/mutation_cost.py: the CEL literals its MutatingAdmissionPolicy is built from (the
policy's output against the webhook's is checked by the bench itself, on a real API server)."""

from __future__ import annotations

from kvgpu.admission import mutate

from bench.scale.mutation_cost import C, cel, policy


def test_a_string_naming_the_container_becomes_a_concatenation() -> None:
    assert cel(f"kvgpu-claim-{C}") == '"kvgpu-claim-" + variables.c + ""'
    assert cel("plain") == '"plain"'


def test_map_values_are_dyn_and_scalars_keep_their_type() -> None:
    assert cel({"a": 1, "b": True, "c": [f"{C}"]}) == '{"a": dyn(1), "b": dyn(true), "c": dyn(["" + variables.c + ""])}'


def test_the_policy_injects_what_the_webhook_injects() -> None:
    spec = policy()["spec"]
    env = next(v["expression"] for v in spec["variables"] if v["name"] == "env")
    names = [e["name"] for e in mutate.injected_env(C)]
    assert [env.index(f'"{n}"') for n in names] == sorted(env.index(f'"{n}"') for n in names)
    assert spec["mutations"][0]["patchType"] == "JSONPatch"
    assert spec["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
