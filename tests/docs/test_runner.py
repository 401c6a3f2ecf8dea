"""The docs runner itself: each kind of block is run as tests/docs/blocks.py says, and a block that
breaks fails its page's test with the page and the line."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.docs.blocks import PageError, file_block, mismatch, parse, substitute
from tests.docs.runner import BlockFailed, PageRun

FENCE = "```"


def page(root: Path, text: str, name: str = "docs/page.md") -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n").replace("'''", FENCE))
    return Path(name)


def run(tmp_path: Path, text: str) -> PageRun:
    root = tmp_path / "root"
    run = PageRun(page(root, text), tmp_path / "work", root)
    run.run()
    return run


def test_files_scripts_commands_and_outputs_run_in_order_in_one_directory(tmp_path: Path) -> None:
    done = run(tmp_path, """
        # A page

        '''python
        # greet.py
        def greet(name: str) -> str:
            return f"hello {name}"
        '''

        It prints:

        '''python
        import greet
        print(greet.greet("docs"))
        '''

        '''text
        hello docs
        '''

        '''sh
        export GREETING=hi
        mkdir sub && cd sub
        '''

        '''console
        $ echo "$GREETING from $(basename "$PWD")" \\
            and more
        hi from sub and more
        '''

        '''toml
        [tool.x]
        y = 1
        '''
        """)
    assert [where.split(":")[1] for where in done.report.ran] == ["11", "20", "25"]
    assert done.report.written == ["docs/page.md:3"] and done.report.checked == ["docs/page.md:31"]
    assert done.report.outputs == ["docs/page.md:16", "docs/page.md:25"]
    assert (done.dir / "greet.py").read_text().startswith("# greet.py\n")
    assert sorted(p.name for p in done.dir.iterdir()) == ["greet.py", "sub"]  # the runner's are elsewhere


@pytest.mark.parametrize(("text", "line", "says"), [
    ("'''python\nraise SystemExit(3)\n'''\n", 1, "exited 3, not 0"),
    ("'''sh\ntrue\n'''\n\n'''sh\nfalse\necho never\n'''\n", 5, "exited 1, not 0"),
    ("'''python\nprint('one')\n'''\n\n'''text\ntwo\n'''\n", 1, "lacks the line 'two'"),
    ("'''console\n$ echo one\ntwo\n'''\n", 1, "lacks the line 'two'"),
    ("'''json\n{\"a\": 1,}\n'''\n", 1, "not valid json"),
    ("'''yaml\na: [1\n'''\n", 1, "not valid yaml"),
    ("<!-- docs: timeout 1 -->\n'''sh\nsleep 5\n'''\n", 2, "still running after 1 s"),
])
def test_a_broken_block_fails_naming_its_page_and_line(tmp_path: Path, text: str, line: int, says: str) -> None:
    with pytest.raises(BlockFailed) as failed:
        run(tmp_path, text)
    assert str(failed.value).startswith(f"docs/page.md:{line}: ") and says in str(failed.value), failed.value


def test_annotations_wait_for_a_server_set_an_expected_exit_and_skip(tmp_path: Path) -> None:
    done = run(tmp_path, """
        <!-- docs: wait http://127.0.0.1:8000/ -->
        '''sh
        PORT=8000; python -m http.server --bind 127.0.0.1 "$PORT" > /dev/null 2>&1 &
        '''

        <!-- docs: env WHO=reader -->
        '''sh
        curl -sf -o /dev/null http://127.0.0.1:8000/ && echo "up for $WHO"
        '''

        '''text
        up for reader
        '''

        <!-- docs: exit 2 -->
        '''sh
        echo "${WHO:-nobody}"; exit 2
        '''

        <!-- docs: not-run needs Docker -->
        '''sh
        docker compose up
        '''
        """)
    assert done.report.not_run == ["docs/page.md:21: needs Docker"]
    assert len(done.report.ran) == 3
    assert done.ports[8000] != 8000  # the page's own port


def test_the_page_database_is_its_own_and_goes_away(tmp_path: Path) -> None:
    done = run(tmp_path, """
        '''sh
        psql postgresql://postgres@127.0.0.1:5432/consumer_kit_docs -tAc 'select current_database()'
        '''

        '''text
        consumer_kit_docs_…
        '''
        """)
    assert done.database is not None and done.database != "consumer_kit_docs"
    assert done.report.outputs == ["docs/page.md:5"]


def test_the_page_rabbitmq_virtual_host_is_its_own_and_goes_away(tmp_path: Path) -> None:
    done = run(tmp_path, """
        '''python
        import asyncio

        import aio_pika


        async def main() -> None:
            async with await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/") as connection:
                channel = await connection.channel()
                await channel.declare_queue("orders", durable=True)
                print("virtual host", connection.url.path)


        asyncio.run(main())
        '''

        '''text
        virtual host /consumer_kit_docs_…
        '''
        """)
    assert done.vhost is not None and done.report.outputs == ["docs/page.md:17"]

    async def connect() -> None:
        await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:5672/{done.vhost}", timeout=10)

    with pytest.raises(aiormq.exceptions.AMQPError):  # deleted at the page's end, with its queue
        asyncio.run(connect())


def test_only_the_default_virtual_host_of_guest_is_replaced() -> None:
    own = "consumer_kit_docs_0a1b2c3d4e5f"
    for written in ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:guest@127.0.0.1:5672/%2F"):
        assert substitute(f"RABBITMQ_URL={written} x", {}, None, own) == \
            f"RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/{own} x"
    for kept in ("amqp://guest:guest@127.0.0.1:5672/shop", "amqp://guest:wrong@127.0.0.1:5672/",
                 "amqp://guest:guest@127.0.0.1/"):
        assert substitute(kept, {}, None, own) == kept


def test_a_checkout_block_runs_in_a_copy_of_the_repository(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "deploy").mkdir(parents=True)
    (root / "deploy" / "marker.txt").write_text("from the checkout\n")
    name = page(root, """
        <!-- docs: checkout -->
        '''sh
        cat deploy/marker.txt
        export SEEN=yes
        touch made-here
        '''

        '''text
        from the checkout
        '''

        '''sh
        echo "seen: $SEEN, here: $(ls -A | wc -l) files"
        '''

        '''text
        seen: yes, here: 0 files
        '''
        """)
    done = PageRun(name, tmp_path / "work", root)
    done.run()
    assert done.report.outputs == ["docs/page.md:8", "docs/page.md:16"]
    assert (done.checkout / "made-here").exists() and not (root / "made-here").exists()


def test_pages_that_break_the_conventions_are_refused(tmp_path: Path) -> None:
    for text, says in [("'''rust\nfn main() {}\n'''\n", "a ```rust block"), ("'''\nplain\n'''\n", "(no language)"),
                       ("<!-- docs: skip -->\n'''sh\ntrue\n'''\n", "unknown annotation"),
                       ("'''sh\ntrue\n", "never closes")]:
        with pytest.raises(PageError, match=r"^docs/page.md:\d+: .*" + says.replace("(", r"\(").replace(")", r"\)")):
            parse(page(tmp_path, text), tmp_path)


def test_the_output_rule() -> None:
    printed = "start\nid 3f2a9c listening\nnoise\nend  \n"
    assert mismatch("id … listening\nend\n", printed) is None
    assert mismatch("end\nstart\n", printed) == "start"  # in order
    assert mismatch("listening\n", printed) == "listening"  # whole lines
    assert mismatch("\n\n", printed) is None


def test_a_written_file_can_be_read_back_for_other_tests(tmp_path: Path) -> None:
    name = page(tmp_path, "'''python\n# app.py\nAPP = 1\n'''\n")
    assert file_block(name, "app.py", tmp_path) == "# app.py\nAPP = 1\n"
    with pytest.raises(LookupError):
        file_block(name, "other.py", tmp_path)
