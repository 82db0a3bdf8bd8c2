"""A CNI call from a hostile runtime: ``CNI_*`` environment (``CNI_ARGS`` too) and stdin.

Property: ``cni_protocol.skel.run`` with the plugins' configuration parsing (tabby's and
tabby-ipam's sections, ``CNI_ARGS``' pod identity and ``IP=``) never raises and answers
exit status 0 with nothing, or 1 with exactly one CNI error object: a known code that is
not 999 (an internal error is a bug: every refusal of input has its own code), in a version
tabby speaks. Nothing is done: the verbs stop after parsing.

Input bytes (atheris): ``KEY=VALUE`` lines, an empty line, then stdin.
"""

from __future__ import annotations

import json
import os

from hypothesis import strategies as st

from cni_protocol import skel
from cni_protocol.args import parse_cni_args
from cni_protocol.errors import Code
from cni_protocol.version import SUPPORTED_VERSIONS
from tests.fuzz import hostile, silenced

#: A configuration every verb accepts (the seeds and the strategies start from it).
BASE_CONFIG: dict[str, object] = {
    "cniVersion": "1.1.0",
    "name": "k8s-pod-network",
    "type": "tabby",
    "mtu": 1440,
    "log_level": "info",
    "ipam": {"type": "tabby-ipam", "ipv4_pools": ["10.244.0.0/16"]},
}
BASE_ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c0ffee",
    "CNI_NETNS": "/run/netns/fuzz-does-not-exist",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/nonexistent-fuzz-cni-path",
    "CNI_ARGS": "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;IP=10.244.0.9",
}


def _parse_only(args: skel.CmdArgs) -> None:
    """What the plugins read of a call before they do anything, and nothing else."""
    from cni_plugin import plugin
    from ipam import plugin as ipam_plugin

    plugin.pod_identity(args)
    plugin.configuration(args)
    conf = ipam_plugin.configuration(args)
    if args.command == "ADD":
        ipam_plugin.requested_ips(conf, parse_cni_args(args.args))


HANDLERS = skel.Handlers(
    add=_parse_only, delete=_parse_only, check=_parse_only, gc=_parse_only, status=_parse_only
)
KNOWN_CODES = {int(c) for c in Code}


def check_answer(rc: int, out: bytes, command: str) -> dict[str, object] | None:
    """The property of one answer; the error object when the call was refused."""
    assert rc in (0, 1), rc
    if rc == 0:
        if command == "VERSION":
            assert json.loads(out)["cniVersion"] in SUPPORTED_VERSIONS
        else:
            assert out == b"", out
        return None
    assert out.endswith(b"\n"), out
    assert out.count(b"\n") == 1, out
    err = json.loads(out)
    assert isinstance(err, dict), err
    assert err["cniVersion"] in SUPPORTED_VERSIONS, err
    assert err["code"] in KNOWN_CODES, err
    assert err["code"] != Code.INTERNAL, f"an internal error for hostile input: {err}"
    assert isinstance(err["msg"], str), err
    assert err["msg"], err
    return err


def call(env: dict[str, str], stdin: bytes) -> dict[str, object] | None:
    with silenced():
        rc, out = skel.run(HANDLERS, env, stdin, own_netns=skel.own_netns_id())
    return check_answer(rc, out, env.get("CNI_COMMAND", ""))


def split(data: bytes) -> tuple[dict[str, str], bytes]:
    """Fuzzer bytes as (environment, stdin): what a process can be given (no NUL in the
    environment, its bytes decoded as Python decodes os.environ)."""
    head, _, stdin = data.partition(b"\n\n")
    env: dict[str, str] = {}
    for line in head.split(b"\n"):
        key, sep, value = line.replace(b"\0", b"").partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env, stdin


def join(env: dict[str, str], stdin: bytes) -> bytes:
    head = b"\n".join(os.fsencode(f"{k}={v}") for k, v in env.items())
    return head + b"\n\n" + stdin


def fuzz_one(data: bytes) -> None:
    env, stdin = split(data)
    call(env, stdin)


# -- hypothesis ---------------------------------------------------------------------------

hostile_text = hostile.texts
hostile_json = hostile.json_values
FIELDS = ["cniVersion", "name", "type", "mtu", "log_level", "log_file_path", "ipam",
          "ipam.type", "ipam.ipv4_pools", "ipam.datastore_type", "ipam.etcd_endpoints",
          "ipam.nodename", "runtimeConfig", "runtimeConfig.ips", "args", "prevResult",
          "container_settings", "veth_prefix"]  # fmt: skip


@st.composite
def configs(draw: st.DrawFn) -> bytes:
    """BASE_CONFIG with hostile values in a few fields, or bytes that are no JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    config = json.loads(json.dumps(BASE_CONFIG))
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        section, _, key = field.partition(".")
        value = draw(hostile_json)
        if key:
            holder = config.setdefault(section, {})
            if isinstance(holder, dict):
                holder[key] = value
        else:
            config[section] = value
    return json.dumps(config).encode("utf-8", "surrogatepass")


@st.composite
def environments(draw: st.DrawFn) -> dict[str, str]:
    env = dict(BASE_ENV)
    env["CNI_COMMAND"] = draw(st.sampled_from([*skel.VERBS, "", "add", "DEL\n"]))
    for key in draw(st.lists(st.sampled_from(sorted(BASE_ENV)), max_size=3)):
        env[key] = draw(hostile_text).replace("\0", "")
    if draw(st.booleans()):
        pairs = draw(st.lists(st.tuples(hostile_text, hostile_text), max_size=4))
        env["CNI_ARGS"] = ";".join(f"{k}={v}" for k, v in pairs).replace("\0", "")
    return env


if __name__ == "__main__":
    os.environ["TABBY_CONFIG_CACHE"] = "off"
    from tests.fuzz.runner import main

    fuzz_one(join(BASE_ENV, json.dumps(BASE_CONFIG).encode()))  # lazy imports, loaded
    main(fuzz_one, ["cni_protocol", "cni_config", "cni_plugin", "ipam"])
