import pytest
from click.testing import CliRunner

from ikcode import paths
from ikcode.cli import main
from ikcode.profiles import ProfileError, list_profiles, load_profile

SHIPPED = {"local", "deepinfer-4xb200", "vllm", "sglang", "remote"}


def test_shipped_profiles_load():
    known = list_profiles()
    assert SHIPPED <= set(known)
    for name in SHIPPED:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.served_model and profile.context_window > 0 and profile.max_output_tokens > 0


def test_local_profile_is_loopback_embedded():
    profile = load_profile()
    assert profile.engine == "embedded"
    assert profile.endpoint.host == "127.0.0.1"
    assert profile.auth.required
    assert profile.base_url == f"http://127.0.0.1:{profile.endpoint.port}"


def write_user_profile(name: str, text: str):
    folder = paths.ensure(paths.user_profiles_dir())
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def test_user_profile_overrides_shipped_by_name():
    path = write_user_profile(
        "local",
        'engine = "embedded"\nserved_model = "mine"\ncontext_window = 4096\nmax_output_tokens = 100\n',
    )
    known = list_profiles()
    assert known["local"].origin == "user" and known["local"].path == path
    assert load_profile("local").served_model == "mine"


def test_profile_by_path(tmp_path):
    path = tmp_path / "team.toml"
    path.write_text(
        'engine = "upstream"\nserved_model = "qwen"\ncontext_window = 32768\nmax_output_tokens = 2048\n'
        '[endpoint]\nport = 9000\npath_prefix = "/gw/"\n'
    )
    profile = load_profile(str(path))
    assert profile.served_model == "qwen"
    assert profile.base_url == "http://127.0.0.1:9000/gw"


def test_malformed_profile_names_file_key_and_expectation(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'engine = "embedded"\nserved_model = "m"\ncontext_window = "big"\nmax_output_tokens = 10\n'
        "[endpoint]\nport = 70000\ncolour = 1\n"
    )
    with pytest.raises(ProfileError) as err:
        load_profile(str(path))
    text = str(err.value)
    assert str(path) in text
    assert "context_window" in text and "integer" in text
    assert "endpoint.port" in text and "65535" in text
    assert "endpoint.colour: unknown key" in text


def test_invalid_toml_and_missing_keys(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("engine = \n")
    with pytest.raises(ProfileError, match="invalid TOML"):
        load_profile(str(path))
    path.write_text('engine = "embedded"\n')
    with pytest.raises(ProfileError, match="served_model: required key is missing"):
        load_profile(str(path))


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ProfileError) as err:
        load_profile("nope")
    assert "unknown profile 'nope'" in str(err.value)
    for name in SHIPPED:
        assert name in str(err.value)


def test_cli_profiles_and_unknown_profile_error():
    runner = CliRunner()
    result = runner.invoke(main, ["profiles"], terminal_width=200)
    assert result.exit_code == 0
    for name in SHIPPED:
        assert name in result.output
    result = runner.invoke(main, ["env", "--profile", "nope"])
    assert result.exit_code != 0
    assert "known profiles" in result.output


def test_a_server_bound_to_every_address_is_reached_on_loopback():
    from ikcode.profiles import load_profile

    profile = load_profile("local")
    for bound, reached in (("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("10.0.0.5", "10.0.0.5")):
        endpoint = profile.endpoint.model_copy(update={"host": bound})
        url = profile.model_copy(update={"endpoint": endpoint}).base_url
        assert url == f"http://{reached}:{profile.endpoint.port}", url


def test_an_empty_host_is_refused(tmp_path):
    """It bound every address and gave the URL http://:8741, which nothing can reach: `ikcode up`
    waited its 600 s for a health answer."""
    path = tmp_path / "p.toml"
    path.write_text(
        'engine = "embedded"\nserved_model = "m"\ncontext_window = 4096\nmax_output_tokens = 10\n'
        '[endpoint]\nhost = ""\n'
    )
    with pytest.raises(ProfileError, match="endpoint.host"):
        load_profile(str(path))


def test_a_file_named_like_a_profile_in_the_working_directory_is_not_it(tmp_path, monkeypatch):
    """A script called `local` beside the user made a plain `ikcode up` fail with "invalid TOML"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").write_text("#!/bin/sh\necho hi\n")
    assert load_profile("local").engine == "embedded"
    assert load_profile().name == "local"
