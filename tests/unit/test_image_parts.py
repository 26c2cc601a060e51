"""Image parts of chat and Responses bodies (rein.openai.images), REIN_LIMIT_MM_PER_PROMPT and
REIN_IMAGE_FETCH's syntax (rein.core.image_limits), and data URLs and bad images as the 400s a
request gets (rein.jobs.image_sources)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from rein.core.image_limits import parse_fetch_policy, parse_mm_limits
from rein.core.images import ImageError
from rein.core.settings import load_settings
from rein.jobs.image_sources import (
    ImageSources,
    decode_data_url,
    image_refs_of,
    load_images,
    store_images,
)
from rein.openai.errors import RequestError
from rein.openai.images import (
    INVALID_IMAGE,
    ImageRef,
    check_image_count,
    image_ref,
    image_refs,
    may_hold_images,
    template_content,
)
from rein.openai.responses import chat_body
from rein.store.filestore import LocalFileStore


def png(width: int = 8, height: int = 6, color=(10, 200, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels, with almost no data after it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + \
        chunk(b"IEND", b"")


# -- parts ---------------------------------------------------------------------------------------

def test_image_url_object_shorthand_and_input_image():
    url = data_url(png())
    assert image_ref({"type": "image_url", "image_url": {"url": url, "detail": "low"}}, "messages[0].content[1]") \
        == ImageRef("data", url, "low", "messages[0].content[1]")
    assert image_ref({"type": "image_url", "image_url": "https://example.com/a.png"}, "p") \
        == ImageRef("url", "https://example.com/a.png", "auto", "p")
    assert image_ref({"type": "input_image", "file_id": "file-abc", "detail": "high"}, "p") \
        == ImageRef("file", "file-abc", "high", "p")
    assert image_ref({"type": "input_image", "image_url": url}, "p").kind == "data"


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url"}, "m.image_url", "object {url, detail}"),
    ({"type": "image_url", "image_url": {"url": 5}}, "m.image_url.url", "must be a string"),
    ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "m.image_url.url", "http(s) URL"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "m.image_url.url", "data: URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "medium"}},
     "m.image_url.detail", "auto, low, high"),
    ({"type": "image_url", "image_url": {"url": "data:,", "size": 3}}, "m.image_url", "unknown field"),
    ({"type": "input_image"}, "m", "exactly one of image_url"),
    ({"type": "input_image", "image_url": "data:,", "file_id": "file-1"}, "m", "exactly one of image_url"),
    ({"type": "input_image", "file_id": 7}, "m.file_id", "file id string"),
    ({"type": "input_image", "file_id": "f", "detail": "max"}, "m.detail", "auto, low, high"),
    ({"type": "image_url", "image_url": "https://x/" + "a" * 9000}, "m.image_url", "at most 8192"),
])
def test_malformed_parts_name_their_field(part, param, words):
    with pytest.raises(RequestError) as caught:
        image_ref(part, "m")
    assert caught.value.param == param and words in caught.value.message


def test_template_content_keeps_text_and_places_images():
    content = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": data_url(png())},
               {"type": "text", "text": " and "}, {"type": "input_image", "file_id": "file-1"}]
    parts = template_content(content, "messages[2]", True)
    assert parts == [{"type": "text", "text": "look: "}, {"type": "image"}, {"type": "text", "text": " and "},
                     {"type": "image"}]
    refs = image_refs([{"role": "user", "content": "x"}, {}, {"role": "user", "content": content}])
    assert [r.param for r in refs] == ["messages[2].content[1]", "messages[2].content[3]"]
    assert template_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "m", True) == "ab"


def test_a_text_only_model_says_it_takes_no_images():
    with pytest.raises(RequestError) as caught:
        template_content([{"type": "image_url"}], "messages[0]", False)
    assert caught.value.code == "images_not_supported" and caught.value.param == "messages[0].content[0]"
    assert "takes no images" in caught.value.message


def test_image_refs_in_prompt_order_and_detection():
    url = data_url(png())
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "x"}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://h/a.png",
                                                                                  "detail": "low"}}]}]
    refs = image_refs(messages)
    assert [(r.kind, r.param, r.detail) for r in refs] == [("data", "messages[1].content[0]", "auto"),
                                                           ("url", "messages[2].content[0]", "low")]
    assert may_hold_images({"messages": messages})
    assert not may_hold_images({"messages": [{"role": "user", "content": "hi"}]})
    assert may_hold_images({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]})


def test_responses_input_image_goes_to_the_chat_body():
    body = chat_body({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "file_id": "file-9"}]}]})
    assert body["messages"][0]["content"] == [{"type": "text", "text": "what is it?"},
                                              {"type": "input_image", "file_id": "file-9"}]
    refs = image_refs(body["messages"])
    assert [(r.kind, r.value) for r in refs] == [("file", "file-9")]
    # text alone stays one string, as before
    assert chat_body({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}
                     )["messages"][0]["content"] == "a"


# -- limits --------------------------------------------------------------------------------------

def test_limit_mm_per_prompt_syntax():
    assert parse_mm_limits("image=4") == {"image": 4}
    assert parse_mm_limits('{"image": 2}') == {"image": 2}
    assert parse_mm_limits("image=0") == {"image": 0}
    for bad in ("image", "video=1", "image=-1", "image=x", '{"image": 1.5}', "[1]", "{bad"):
        with pytest.raises(ValueError, match="REIN_LIMIT_MM_PER_PROMPT"):
            parse_mm_limits(bad)


def test_limit_mm_per_prompt_setting_is_checked(monkeypatch):
    assert load_settings(limit_mm_per_prompt="image=2").limit_mm_per_prompt == "image=2"
    with pytest.raises(Exception, match="REIN_LIMIT_MM_PER_PROMPT"):
        load_settings(limit_mm_per_prompt="audio=1")


def test_too_many_images_name_the_limit():
    refs = [ImageRef("data", "data:,", "auto", f"messages[0].content[{i}]") for i in range(3)]
    check_image_count(refs, {"image": 3})
    with pytest.raises(RequestError) as caught:
        check_image_count(refs, {"image": 2})
    assert caught.value.param == "messages[0].content[2]" and caught.value.code == INVALID_IMAGE
    assert "at most 2" in caught.value.message and "REIN_LIMIT_MM_PER_PROMPT" in caught.value.message


def test_fetch_policy_syntax():
    assert not parse_fetch_policy("off").enabled
    assert parse_fetch_policy("on").allows("anything.example")
    policy = parse_fetch_policy("images.example.com, .cdn.example.org")
    assert policy.allows("images.example.com") and policy.allows("IMAGES.example.com.")
    assert policy.allows("cdn.example.org") and policy.allows("a.b.cdn.example.org")
    assert not policy.allows("example.com") and not policy.allows("evilcdn.example.org")
    with pytest.raises(ValueError, match="REIN_IMAGE_FETCH"):
        parse_fetch_policy("http://x/")


# -- data URLs -----------------------------------------------------------------------------------

def test_data_url_decodes():
    data = png()
    assert decode_data_url(data_url(data), 1 << 20) == data
    assert decode_data_url("data:;base64," + base64.b64encode(data).decode(), 1 << 20) == data


@pytest.mark.parametrize("url, words", [
    ("data:image/png," + "x" * 10, "base64"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png;base64,%%%%", "does not decode"),
    ("data:image/png;base64", "malformed"),
])
def test_bad_data_urls(url, words):
    with pytest.raises(ImageError, match=words):
        decode_data_url(url, 1 << 20)


def test_data_url_size_is_judged_before_decoding():
    # 3 MB of base64 that would not even decode: refused by its length alone, naming the limit
    with pytest.raises(ImageError, match=r"limit is 1,000 bytes \(REIN_MAX_IMAGE_BYTES\)"):
        decode_data_url("data:image/png;base64," + "!" * 3_000_000, 1000)


# -- bad images, as a request's 400s ---------------------------------------------------------------

def load_one(url: str, **overrides) -> list:
    sources = ImageSources(load_settings(**overrides))
    return sources.for_request("tenant").load([ImageRef("data", url, "auto", "messages[0].content[1]")])


def refused(url: str, **overrides) -> RequestError:
    with pytest.raises(RequestError) as caught:
        load_one(url, **overrides)
    assert caught.value.param == "messages[0].content[1]" and caught.value.code == INVALID_IMAGE
    return caught.value


def test_a_good_image_loads_and_opens():
    images, opened = load_one(data_url(png(8, 6)))
    assert opened[0].size == (8, 6) and images[0].data == png(8, 6) and images[0].detail == "auto"
    # checked in full, but handed on undecoded: the processor counts tokens from the size alone
    assert opened[0]._im is None
    assert opened[0].convert("RGB").getpixel((0, 0)) == (10, 200, 30)   # its pixels, when read


def test_corrupt_image():
    data = png(64, 64, (1, 2, 3))
    assert "corrupt or truncated" in refused(data_url(data[: len(data) // 2])).message
    assert "not an image rein can read" in refused(data_url(b"hello, not an image")).message


def test_decompression_bomb_is_refused_by_its_declared_size():
    error = refused(data_url(bomb_png(100_000, 100_000)))   # past Pillow's own guard too
    assert "too many pixels" in error.message and "REIN_MAX_IMAGE_PIXELS" in error.message
    error = refused(data_url(bomb_png(10_000, 10_000)))     # 100 MP: under Pillow's error, over rein's cap
    assert "10000x10000" in error.message and "the limit is 64,000,000 pixels" in error.message
    error = refused(data_url(png(40, 30)), max_image_pixels=1000)
    assert "the limit is 1,000 pixels" in error.message


def test_unsupported_format():
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "ICO")
    assert "ICO format are not taken" in refused(data_url(out.getvalue(), "image/x-icon")).message


def test_too_large_image():
    error = refused(data_url(png(64, 64)), max_image_bytes=100)
    assert "REIN_MAX_IMAGE_BYTES" in error.message and "100 bytes" in error.message


def test_the_count_limit_applies_before_anything_is_loaded():
    sources = ImageSources(load_settings(limit_mm_per_prompt="image=1"))
    refs = [ImageRef("url", "http://10.0.0.1/a.png", "auto", f"messages[0].content[{i}]") for i in range(2)]
    with pytest.raises(RequestError, match="at most 1"):
        sources.for_request("t").load(refs)


def test_a_url_is_refused_while_fetching_is_off():
    sources = ImageSources(load_settings(image_fetch="off"))
    with pytest.raises(RequestError, match="REIN_IMAGE_FETCH=off") as caught:
        sources.for_request("t").load([ImageRef("url", "https://example.com/a.png", "auto", "messages[0].content[0]")])
    assert caught.value.param == "messages[0].content[0]"


# -- storage ---------------------------------------------------------------------------------------

def test_images_are_stored_once_by_sha256_and_read_back(tmp_path):
    store = LocalFileStore(tmp_path)
    images, _ = load_one(data_url(png(5, 5)))
    store_images(store, images)
    store_images(store, images)       # idempotent
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"image-{images[0].sha256}"]
    refs = image_refs_of(images)
    assert refs == [{"sha256": images[0].sha256, "detail": "auto"}]
    assert load_images(store, refs) == images
    (tmp_path / files[0]).write_bytes(b"tampered")
    with pytest.raises(ValueError, match="does not match"):
        load_images(store, refs)
    with pytest.raises(FileNotFoundError):
        load_images(store, [{"sha256": "0" * 64, "detail": "auto"}])


def test_a_job_keeps_its_body_without_image_bytes():
    from rein.openai.images import without_image_data

    url = data_url(png())
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "image_url", "image_url": url}, {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]}
    kept = without_image_data(body)
    parts = kept["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "hi"} and parts[3] == body["messages"][0]["content"][3]
    assert parts[1]["image_url"]["detail"] == "low" and parts[1]["image_url"]["url"] == parts[2]["image_url"]
    assert parts[2]["image_url"].startswith("data:omitted;sha256=") and "base64" not in str(kept)
    assert body["messages"][0]["content"][1]["image_url"]["url"] == url      # the request itself untouched
    assert without_image_data(body) == kept                                   # the same request, the same record
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert without_image_data(plain) is plain
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    assert without_image_data(responses)["input"][0]["content"][0]["image_url"].startswith("data:omitted")
