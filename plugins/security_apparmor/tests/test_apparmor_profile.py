"""Rendered profiles compile with apparmor_parser's parse-only mode (no kernel needed), for a
kernel with every AppArmor 3.0 feature and for Debian 12's stock kernel; a broken profile does
not; paths from settings match only themselves, whatever characters they hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dsec_security_apparmor.parser import check_profile
from dsec_security_apparmor.profile import ancestors, quote, render

from dsec_core.errors import ToolError
from dsec_core.security import FileRules

#: A kernel with every feature of the policy ABI the profiles declare (Ubuntu's kernels are).
FULL = Path("/etc/apparmor.d/abi/3.0")
#: The features of Debian 12's stock kernel, as Debian's apparmor package pins them: no unix
#: socket mediation.
DEBIAN = Path("/usr/share/apparmor-features/features")

SETTINGS = {
    "empty": {},
    "read_only": {"read_only": ["/usr/local/bin", "/opt/harness"]},
    "hidden": {"hidden": ["/judge", "/var/log/harness.log"]},
    "scope_signal": {"scope": ["signal"]},
    "scope_abstract_unix": {"scope": ["abstract_unix"]},
    "everything": {
        "read_only": ["/usr/local/bin", "/usr/local/lib/python3.11"],
        "hidden": ["/judge", "/usr/local/share/answers"],
        "scope": ["signal", "abstract_unix"],
    },
    "odd_paths": {
        "read_only": ["/opt/my tools", "/data/*", "/data/[ab]?", "/x/{a,b}", "/h/@{HOME}"],
        "hidden": ['/q/a"b', "/b/back\\slash", "/n/new\nline", "/u/ünïcode", "/c/a,b^c#d"],
    },
}


def rules(settings: dict) -> FileRules:
    return FileRules.parse(settings, "apparmor")


def features(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not there (Debian's apparmor package ships it)")
    return path


@pytest.mark.parametrize("case", sorted(SETTINGS))
def test_rendered_profiles_parse(apparmor_parser, case):
    profile = render(rules(SETTINGS[case]))
    assert re.fullmatch(r"dsec-[0-9a-f]{12}", profile.name)
    assert f"profile {profile.name} flags=(attach_disconnected,mediate_deleted) {{" in profile.text
    check_profile(profile.text, kernel_features=features(FULL), strict=profile.strict)
    if not profile.strict:  # no unix scope: it loads on Debian 12's stock kernel too
        check_profile(profile.text, kernel_features=features(DEBIAN))


def test_abstract_unix_scope_is_refused_where_the_kernel_would_drop_its_rules(apparmor_parser):
    # Without unix mediation the parser would downgrade the scope's rules to `network unix`,
    # which allows every unix socket: a strict profile fails instead of loading unenforced.
    profile = render(rules({"scope": ["abstract_unix"]}))
    assert profile.strict
    with pytest.raises(ToolError) as e:
        check_profile(profile.text, kernel_features=features(DEBIAN), strict=True)
    assert e.value.exit_code != 0 and "unix" in e.value.stderr


@pytest.mark.parametrize(
    "breakage",
    [
        lambda text: text.replace("  file,\n", "  file,\n  bogus rule here,\n"),
        lambda text: text.rstrip().removesuffix("}"),  # the profile never closes
        lambda text: text.replace('"/judge{,/**}"', '"/judge{,/**}'),  # an unterminated quote
        lambda text: text.replace("  umount,\n", '  "/x/@{UNDEFINED}" r,\n'),
    ],
    ids=["unknown-rule", "unclosed", "unterminated-quote", "undefined-variable"],
)
def test_a_broken_profile_fails_the_check(apparmor_parser, breakage):
    text = render(rules({"hidden": ["/judge"]})).text
    check_profile(text, kernel_features=features(FULL))  # the original is fine
    broken = breakage(text)
    assert broken != text
    with pytest.raises(ToolError) as e:
        check_profile(broken, kernel_features=features(FULL))
    assert e.value.exit_code == 1 and e.value.stderr
    assert e.value.command[:3] == [apparmor_parser, "-Q", "-K"]


def test_names_follow_the_settings():
    a = render(rules({"read_only": ["/a"], "scope": ["signal", "abstract_unix"]}))
    assert a == render(rules({"read_only": ["/a"], "scope": ["abstract_unix", "signal"]}))
    others = [
        render(rules(s)).name
        for s in ({}, {"read_only": ["/b"]}, {"hidden": ["/a"]}, {"read_only": ["/a"]})
    ]
    assert len({a.name, *others}) == 5


def test_protected_paths_are_denied_with_their_ancestors():
    text = render(rules({"read_only": ["/usr/local/bin"], "hidden": ["/judge/answers"]})).text
    assert '  deny "/usr/local/bin{,/**}" wl,\n' in text
    assert '  deny "/judge/answers{,/**}" rwlkmx,\n' in text
    for above in ("/usr", "/usr/local", "/judge"):
        assert f'  deny "{above}{{,/}}" w,\n' in text
    assert ancestors("/a/b/c") == ["/a", "/a/b"]
    # docker-default's denials are in every profile, with dsec's /proc/kpage*
    for rule in (
        "deny mount,",
        "deny /proc/kcore rwklx,",
        "deny /proc/kpage* rwklx,",
        "deny /sys/firmware/** rwklx,",
        "deny /proc/sys/kernel/{?,??,[^s][^h][^m]**} w,",
    ):
        assert f"\n  {rule}" in text


def test_scopes_become_peer_rules():
    plain = render(rules({})).text
    assert "  signal,\n" in plain and "  network,\n" in plain and "unix" not in plain
    scoped = render(rules({"scope": ["signal", "abstract_unix"]})).text
    assert "  signal,\n" not in scoped and "  network,\n" not in scoped
    assert "  signal (send, receive) peer=@{profile_name},\n" in scoped
    assert "  unix (connect, send, receive, accept) peer=(label=@{profile_name}),\n" in scoped
    assert "network unix" not in scoped


# --- paths match only themselves ---------------------------------------------------------------
# The parser is the judge of what a path pattern matches: two exec rules with different exec
# modes (ix, px) whose patterns overlap cannot be compiled ("conflicting x modifiers"). Both
# patterns get a trailing `*` so neither is an exact path (an exact path would take precedence
# over a pattern instead of conflicting). So "`quote(P)*` and `S*` compile together" means no
# path starting with S is matched by the rule for P.


def overlap(left: str, right: str) -> bool:
    """Whether AppArmor patterns ``left`` and ``right`` (quoted strings) both match a path."""
    text = (
        "abi <abi/3.0>,\nprofile oracle {\n"
        f"  {left[:-1]}*\" ix,\n  {right[:-1]}*\" px,\n}}\n"
    )  # fmt: skip
    try:
        check_profile(text, kernel_features=features(FULL))
    except ToolError as e:
        assert "conflicting x modifiers" in e.stderr, e.stderr
        return True
    return False


#: (a path from settings, a different path that reading it as a pattern would match, how a
#: careless renderer would write it)
WIDENINGS = [
    ("/data/*", "/data/secret", '"/data/*"'),
    ("/data/**", "/data/x/y", '"/data/**"'),
    ("/data/?", "/data/x", '"/data/?"'),
    ("/data/[ab]", "/data/a", '"/data/[ab]"'),
    ("/data/[^a]", "/data/b", '"/data/[^a]"'),
    ("/data/{a,b}", "/data/a", '"/data/{a,b}"'),
    ("/data/{,x}y", "/data/y", '"/data/{,x}y"'),
    ("/x/@{profile_name}", "/x/oracle", '"/x/@{profile_name}"'),  # the parser defines it
    # a backslash before a glob: escaping the glob but not the backslash leaves `\\*`, an
    # escaped backslash and then a live `*`
    ("/data/a\\*", "/data/a\\zzz", '"/data/a\\\\*"'),
    ("/opt/my tools/*", "/opt/my tools/x", '"/opt/my tools/*"'),
]


@pytest.mark.parametrize(("path", "other", "careless"), WIDENINGS)
def test_a_path_matches_only_itself(apparmor_parser, path, other, careless):
    assert overlap(quote(path), quote(path))  # the oracle sees a path match itself
    assert overlap(careless, quote(other))  # and sees the careless rule widen
    assert not overlap(quote(path), quote(other))
    rendered = render(rules({"hidden": [path]})).text
    assert f'  deny {quote(path)[:-1]}{{,/**}}" rwlkmx,\n' in rendered


def test_odd_bytes_are_escaped_one_by_one():
    assert quote("/a b") == '"/a b"'
    assert quote('/q"x') == '"/q\\"x"'
    assert quote("/n\nl") == '"/n\\012l"'
    assert quote("/é") == '"/\\303\\251"'
    assert quote("/x/@{HOME}") == '"/x/\\@\\{HOME\\}"'
