"""The flags users bring their own models with (rein.model.tokenizer_files): --tokenizer,
--revision / --tokenizer-revision, --chat-template (a file or inline) and --trust-remote-code,
through `rein generate`, `rein.LLM` and the API's model registry, with no network."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from rein.cli.main import main
from rein.core.settings import ServedModel, SettingsError, load_settings
from rein.jobs.registry import ModelLoadError, load_model
from rein.model.implementation import spec_for
from rein.model.tokenizer_files import (
    ChatTemplateError,
    RemoteCodeRequired,
    TokenizerOptions,
    load_tokenizer,
    read_chat_template,
)
from rein.offline.llm import LLM
from rein.openai.prompts import chat_prompt

pytestmark = pytest.mark.usefixtures("clean_rein_env")

TEMPLATE = "TEMPLATE {% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi there"}]
ENGINE = {"kv_cache_memory": "8MiB", "max_model_len": 64, "max_num_seqs": 2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def templated_ids(tokenizer, template: str) -> list[int]:
    """The prompt ids `template` makes of MESSAGES, computed apart from rein."""
    return tokenizer.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def copy_tokenizer(model_dir: Path, out: Path, **config_changes) -> Path:
    out.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE)


# -- --chat-template ---------------------------------------------------------------------------


def test_chat_template_file_and_inline_replace_the_tokenizers(model_dir, tmp_path, llm):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    tokenizer = llm.get_tokenizer()
    expected = templated_ids(tokenizer, TEMPLATE)
    assert expected != llm.chat(MESSAGES, use_tqdm=False)[0].prompt_token_ids   # the model's own differs
    for given in (str(path), TEMPLATE):
        templated = LLM(str(model_dir), chat_template=given, **ENGINE)
        assert templated.get_tokenizer().chat_template == TEMPLATE
        assert templated.chat(MESSAGES, use_tqdm=False)[0].prompt_token_ids == expected, given


def test_the_api_registry_builds_the_same_chat_prompt(model_dir, tokenizer):
    served = ServedModel(name="tiny", source=str(model_dir))
    entry = load_model(served, tokenizer_options=TokenizerOptions(chat_template=TEMPLATE))
    ids = chat_prompt({"messages": MESSAGES}, entry.tokenizer, entry.max_model_len)
    assert ids == templated_ids(tokenizer, TEMPLATE)
    assert chat_prompt({"messages": MESSAGES}, load_model(served).tokenizer, 64) != ids
    # REIN_CHAT_TEMPLATE is what `rein api --chat-template` sets for its processes
    settings = load_settings(models=f"tiny={model_dir}", chat_template=TEMPLATE)
    assert TokenizerOptions.of(settings).chat_template == TEMPLATE


def test_generate_chat_takes_the_template(model_dir, tmp_path, tokenizer, capsys):
    args = ["generate", "--model", str(model_dir), "Hi there", "--chat", "--max-tokens", "1",
            "--kv-cache-memory", "8MiB", "--max-model-len", "64"]

    def prompt_tokens(*extra: str) -> int:
        assert main([*args, *extra]) == 0
        return int(re.search(r"\[(\d+) prompt tokens", capsys.readouterr().err).group(1))

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    expected = len(templated_ids(tokenizer, TEMPLATE))
    assert prompt_tokens() != expected
    assert prompt_tokens("--chat-template", str(path)) == expected
    assert prompt_tokens("--chat-template", TEMPLATE) == expected


def test_a_bad_chat_template_is_refused_saying_why(model_dir, tmp_path, capsys):
    with pytest.raises(ChatTemplateError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match=r"inline template\) is not a valid Jinja template"):
        read_chat_template("{% for m in messages %}{{ m.content }}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{{ messages[0]['content'] }\n")
    with pytest.raises(ChatTemplateError, match=rf"file {broken}\) is not a valid Jinja template \(line 2\)"):
        read_chat_template(str(broken))
    assert main(["generate", "--model", str(model_dir), "Hi", "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="not a valid Jinja template"):
        load_model(ServedModel(name="tiny", source=str(model_dir)),
                   tokenizer_options=TokenizerOptions(chat_template="{{ oops"))


# -- --tokenizer -------------------------------------------------------------------------------


def test_tokenizer_from_another_directory_is_used(model_dir, tmp_path):
    other = copy_tokenizer(model_dir, tmp_path / "tokenizer", chat_template=TEMPLATE)
    templated = LLM(str(model_dir), tokenizer=str(other), **ENGINE)
    assert templated.get_tokenizer().name_or_path == str(other)
    assert templated.chat(MESSAGES, use_tqdm=False)[0].prompt_token_ids == \
        templated_ids(templated.get_tokenizer(), TEMPLATE)
    entry = load_model(ServedModel(name="tiny", source=str(model_dir)),
                       tokenizer_options=TokenizerOptions(tokenizer=str(other)))
    assert entry.tokenizer.chat_template == TEMPLATE
    with pytest.raises(ModelLoadError, match="--tokenizer .*not a directory"):
        load_model(ServedModel(name="tiny", source=str(model_dir)),
                   tokenizer_options=TokenizerOptions(tokenizer=str(tmp_path / "none")))


# -- --revision --------------------------------------------------------------------------------


def test_revisions_reach_the_hub_download(model_dir, monkeypatch):
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], "*.safetensors" in kwargs["allow_patterns"]))
        return str(model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    LLM("someone/model", revision="v2", tokenizer="someone/tokenizer", tokenizer_revision="t1", **ENGINE)
    assert calls == [("someone/model", "v2", True), ("someone/tokenizer", "t1", False)]
    calls.clear()
    load_model(ServedModel(name="m", source="someone/model"), revision="abc123")
    assert calls == [("someone/model", "abc123", False)]       # the API fetches no weights


def test_per_model_settings_refuse_several_served_models(model_dir):
    with pytest.raises(SettingsError, match="REIN_CHAT_TEMPLATE name one model's files"):
        load_settings(models=f"a={model_dir},b={model_dir}", chat_template=TEMPLATE)
    assert load_settings(models=f"a={model_dir},b={model_dir}", trust_remote_code=True).trust_remote_code


# -- --trust-remote-code -----------------------------------------------------------------------

# A model that is the repository's own code: a Llama under another model_type, as a hub repo
# with custom modeling files would ship it.
CONFIGURATION = """from transformers import LlamaConfig


class ReinCustomConfig(LlamaConfig):
    model_type = "rein_custom"
"""
MODELING = """from transformers import LlamaForCausalLM

from .configuration_rein_custom import ReinCustomConfig


class ReinCustomForCausalLM(LlamaForCausalLM):
    config_class = ReinCustomConfig
"""


@pytest.fixture
def remote_code_model(model_dir, tmp_path, monkeypatch) -> Path:
    import transformers.dynamic_module_utils as dynamic

    # transformers copies a repository's code into its modules cache before importing it.
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    out = tmp_path / "custom"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="rein_custom", architectures=["ReinCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_rein_custom.ReinCustomConfig",
                            "AutoModelForCausalLM": "modeling_rein_custom.ReinCustomForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_rein_custom.py").write_text(CONFIGURATION)
    (out / "modeling_rein_custom.py").write_text(MODELING)
    return out


def test_remote_code_is_refused_without_the_flag(remote_code_model, capsys):
    for model_impl in ("auto", "transformers"):
        with pytest.raises(RemoteCodeRequired, match="auto_map.*--trust-remote-code"):
            spec_for(remote_code_model, model_impl)
    assert main(["generate", "--model", str(remote_code_model), "Hi", "--kv-cache-memory", "8MiB"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    with pytest.raises(RemoteCodeRequired, match="--trust-remote-code"):
        LLM(str(remote_code_model), **ENGINE)


def test_remote_code_runs_with_the_flag(remote_code_model, llm, capsys):
    assert main(["generate", "--model", str(remote_code_model), "Hi", "--max-tokens", "2", "--trust-remote-code",
                 "--kv-cache-memory", "8MiB", "--max-model-len", "64"]) == 0, capsys.readouterr().err
    trusted = LLM(str(remote_code_model), trust_remote_code=True, **ENGINE)
    assert trusted.engine.spec.architecture == "ReinCustomForCausalLM"
    assert type(trusted.engine.runner.model.hf_model).__name__ == "ReinCustomForCausalLM"
    params = trusted.get_default_sampling_params()
    params.temperature, params.max_tokens = 0.0, 6
    ours = trusted.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_remote_code_tokenizer_is_refused_without_the_flag(model_dir, tmp_path):
    custom = copy_tokenizer(model_dir, tmp_path / "tokenizer", tokenizer_class="ReinCustomTokenizer",
                            auto_map={"AutoTokenizer": ["tokenization_rein.ReinCustomTokenizer", None]})
    with pytest.raises(RemoteCodeRequired, match=r"tokenization_rein\.ReinCustomTokenizer.*--trust-remote-code"):
        load_tokenizer(model_dir, TokenizerOptions(tokenizer=str(custom)))
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        load_model(ServedModel(name="tiny", source=str(model_dir)),
                   tokenizer_options=TokenizerOptions(tokenizer=str(custom)))
    # a class transformers has itself loads without the repository's code
    known = copy_tokenizer(model_dir, tmp_path / "known",
                           auto_map={"AutoTokenizer": ["tokenization_rein.ReinCustomTokenizer", None]})
    assert load_tokenizer(model_dir, TokenizerOptions(tokenizer=str(known))).name_or_path == str(known)


def test_a_worker_flag_the_api_does_not_read_warns(caplog):
    import argparse

    from rein.cli.worker import _warn_if_tokenizer_differs
    from rein.core.settings import Settings

    flags = argparse.Namespace(tokenizer="/tok", tokenizer_revision=None, chat_template=TEMPLATE, revision=None)
    _warn_if_tokenizer_differs(flags, Settings(chat_template=TEMPLATE))
    assert [r.getMessage() for r in caplog.records] == [
        "--tokenizer differs from REIN_TOKENIZER, which the API encodes requests with: set REIN_TOKENIZER "
        "instead, which the API reads too"]
