"""Document sources and output locations, against real files, a real S3 server and real
databases (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from connectors import (
    DatasetSource,
    LocalSource,
    OutputError,
    S3Source,
    SourceError,
    SqlSource,
    check_output,
    open_output,
    open_source,
)
from connectors.processes import free_port
from connectors.reading import SourceDatasource, blocks_of, read_shard
from connectors.seaweedfs import S3Server
from operators.core.document import DOCUMENT_SCHEMA
from tests.services import require_credential_checks

# conftest.py registers the same plugin; naming it here too lets this file run on its own.
pytest_plugins = ["tests.services"]

CORPORA = Path(__file__).resolve().parents[1].parent / "shared" / "corpora"
TEXTS = CORPORA / "text"
REPORTS = CORPORA / "pdfs" / "reports"

needs_corpora = pytest.mark.usefixtures("corpora")  # which fails when they are missing


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# --- local files ------------------------------------------------------------------------------


@pytest.fixture
def local_tree(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    write(docs / "b.txt", "bee")
    write(docs / "a.txt", "ay")
    write(docs / "a.txt.questions.txt", "Who?\n\n  What?  \n")
    write(docs / "sub" / "c.md", "# sea")
    write(docs / "sub" / "c.md.questions.json", json.dumps(["Where?"]))
    write(docs / "sub" / "d.pdf", b"%PDF-1.4 fake")
    write(docs / ".hidden.txt", "secret")
    write(docs / ".git" / "config", "[core]")
    return docs


def test_local_folder_is_recursive_sorted_and_skips_hidden_and_sidecars(local_tree: Path) -> None:
    source = LocalSource([str(local_tree)])
    source.check()
    items = list(source.documents())
    assert [item.name for item in items] == ["a.txt", "b.txt", "c.md", "d.pdf"]
    assert items[0].questions == ("Who?", "What?")
    assert items[2].questions == ("Where?",)
    assert items[1].questions == ()
    assert items[0].uri == (local_tree / "a.txt").as_uri()
    assert items[0].size == 2
    assert [source.read_bytes(item) for item in items[:2]] == [b"ay", b"bee"]


def test_local_globs_files_and_duplicates(local_tree: Path) -> None:
    paths = [str(local_tree / "**" / "*.md"), str(local_tree / "b.txt"), str(local_tree / "sub")]
    items = list(LocalSource(paths).documents())
    assert [item.name for item in items] == ["c.md", "b.txt", "d.pdf"]
    assert items[0].questions == ("Where?",)


def test_local_missing_paths_fail_early(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no input files"):
        LocalSource([str(tmp_path / "nope")]).check()
    with pytest.raises(SourceError, match="no input files"):
        LocalSource([str(tmp_path / "*.pdf")]).check()
    with pytest.raises(SourceError, match="no input path"):
        LocalSource([]).check()


@needs_corpora
def test_local_real_corpus_reads_back_every_byte() -> None:
    source = LocalSource([str(TEXTS), str(REPORTS / "*.pdf")])
    source.check()
    items = list(source.documents())
    expected = sorted(TEXTS.iterdir()) + sorted(REPORTS.glob("*.pdf"))
    assert [item.name for item in items] == [path.name for path in expected]
    for item, path in zip(items, expected, strict=True):
        assert item.size == path.stat().st_size
    assert source.read_bytes(items[0]) == expected[0].read_bytes()
    assert pickle.loads(pickle.dumps(source)).read_bytes(items[-1]) == expected[-1].read_bytes()


# --- S3 ---------------------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = f"docs-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@needs_corpora
@pytest.mark.server
def test_s3_lists_and_reads_real_files(s3_server: S3Server, bucket: str) -> None:
    client = s3_server.client()
    files = sorted(TEXTS.iterdir()) + sorted(REPORTS.glob("*.pdf"))[:2]
    for path in files:
        client.upload_file(str(path), bucket, f"corpus/{path.name}")
    client.put_object(
        Bucket=bucket, Key="corpus/rfc2616-http-1.1.txt.questions.txt", Body=b"Q1\nQ2"
    )
    client.put_object(Bucket=bucket, Key="corpus/.DS_Store", Body=b"junk")
    client.put_object(Bucket=bucket, Key="elsewhere/ignored.txt", Body=b"not under the prefix")

    source = S3Source(f"s3://{bucket}/corpus/", endpoint_url=s3_server.endpoint_url)
    source.check()
    items = list(source.documents())

    by_name = {path.name: path for path in files}
    assert [item.name for item in items] == sorted(by_name)
    for item in items:
        assert item.uri == f"s3://{bucket}/corpus/{item.name}"
        assert item.size == by_name[item.name].stat().st_size
        assert item.metadata["etag"] and item.metadata["last_modified"]
        assert source.read_bytes(item) == by_name[item.name].read_bytes()
    questions = {item.name: item.questions for item in items}
    assert questions["rfc2616-http-1.1.txt"] == ("Q1", "Q2")
    assert questions[files[0].name] == ()

    shipped = pickle.loads(pickle.dumps(source))  # as to a Ray worker: the client is made anew
    assert [item.name for item in shipped.documents()] == sorted(by_name)


@pytest.mark.server
def test_s3_sidecars_across_pages(s3_server: S3Server, bucket: str) -> None:
    client = s3_server.client()
    for number in range(7):
        client.put_object(Bucket=bucket, Key=f"in/doc{number}.txt", Body=f"doc {number}".encode())
        if number % 2 == 0:
            sidecar = json.dumps({"questions": [f"Q{number}?"]}).encode()
            client.put_object(Bucket=bucket, Key=f"in/doc{number}.txt.questions.json", Body=sidecar)
    source = S3Source(f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url, page_size=2)
    items = list(source.documents())
    assert [item.name for item in items] == [f"doc{number}.txt" for number in range(7)]
    assert [item.questions for item in items] == [
        (f"Q{number}?",) if number % 2 == 0 else () for number in range(7)
    ]


@pytest.mark.server
def test_s3_missing_bucket_or_prefix_fails_early(s3_server: S3Server, bucket: str) -> None:
    missing = S3Source("s3://no-such-bucket-memstream/x", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(SourceError, match="does not exist"):
        missing.check()
    empty = S3Source(f"s3://{bucket}/nothing-here/", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(SourceError, match="no objects under"):
        empty.check()
    with pytest.raises(SourceError, match="not an S3 URI"):
        S3Source("s3:///prefix-without-bucket")


@pytest.mark.server
def test_s3_wrong_credentials_fail_early_without_the_secret(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_credential_checks(s3_server)
    s3_server.client().put_object(Bucket=bucket, Key="a.txt", Body=b"a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    source = S3Source(f"s3://{bucket}/", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(SourceError, match="access denied") as raised:
        source.check()
    assert "wrong-secret-value" not in str(raised.value)
    assert "\n" not in str(raised.value)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unknown-key")
    with pytest.raises(SourceError, match="InvalidAccessKeyId"):
        S3Source(f"s3://{bucket}/", endpoint_url=s3_server.endpoint_url).check()


@pytest.mark.server
def test_s3_read_task_lists_lazily_and_fetches_through_pyarrow(
    s3_server: S3Server, bucket: str
) -> None:
    client = s3_server.client()
    bodies = {f"in/doc{number}.txt": f"document {number}".encode() for number in range(5)}
    for key, body in bodies.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    client.put_object(Bucket=bucket, Key="in/doc1.txt.questions.json", Body=b"[not json")
    source = S3Source(f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url, page_size=2)
    assert source.shards(8) == ["in/"]  # one shard: the prefix, listed in its read task
    assert sorted(source.sizes()) == sorted(len(body) for body in bodies.values())
    shipped = pickle.loads(pickle.dumps(source))  # as Ray ships it to the read task
    rows = [row for block in read_shard(shipped, 3, "in/") for row in block.to_pylist()]
    assert [row["uri"] for row in rows] == [f"s3://{bucket}/{key}" for key in sorted(bodies)]
    # each object's bytes, but for the one whose questions cannot be read: an error row
    expected = [None if key == "in/doc1.txt" else bodies[key] for key in sorted(bodies)]
    assert [row["data"] for row in rows] == expected
    assert {row["source_index"] for row in rows} == {3}
    errors = {row["name"]: row["error"] for row in rows if row["error"]}
    assert list(errors) == ["doc1.txt"] and "not valid JSON" in errors["doc1.txt"]
    assert isinstance(shipped.filesystem, pafs.S3FileSystem)


@pytest.mark.server
def test_s3_object_reads_fail_in_one_line_without_the_secret(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_credential_checks(s3_server)
    s3_server.client().put_object(Bucket=bucket, Key="a.txt", Body=b"a")
    source = S3Source(f"s3://{bucket}/", endpoint_url=s3_server.endpoint_url, max_attempts=1)
    (item,) = source.documents()
    with pytest.raises(SourceError, match="does not exist"):
        source.read_bytes(replace(item, uri=f"s3://{bucket}/missing.txt"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    wrong = S3Source(f"s3://{bucket}/", endpoint_url=s3_server.endpoint_url, max_attempts=2)
    with pytest.raises(SourceError, match="access denied") as raised:
        wrong.read_bytes(item)
    assert "wrong-secret-value" not in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.server
def test_s3_user_metadata_is_fetched_by_one_head_request_an_object_only_when_asked(
    s3_server: S3Server, bucket: str
) -> None:
    client = s3_server.client()
    filed = {"q1.txt": "2023-08-04", "q2.txt": "2023-02-03", "q3.txt": "2023-05-05"}
    for name, day in filed.items():
        user = {"Filed": day, "etag": "not-its-etag"}  # a listed field is never overridden
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=name.encode(), Metadata=user)
    client.put_object(Bucket=bucket, Key="in/q4.txt", Body=b"q4")  # no user metadata

    def counted(source: S3Source) -> dict[str, list[str]]:
        calls: dict[str, list[str]] = {"HeadObject": [], "ListObjectsV2": []}
        for operation, keys in calls.items():
            source.client.meta.events.register(
                f"before-parameter-build.s3.{operation}",
                lambda params, keys=keys, **_: keys.append(params.get("Key", "")),
            )
        return calls

    plain = S3Source(f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url, page_size=2)
    calls = counted(plain)
    listed = list(plain.documents())
    assert calls == {"HeadObject": [], "ListObjectsV2": ["", ""]}  # two pages, no HEAD
    assert all(set(item.metadata) == {"etag", "last_modified"} for item in listed)

    asked = S3Source(
        f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url, page_size=2, user_metadata=True
    )
    calls = counted(asked)
    items = list(asked.documents())
    assert sorted(calls["HeadObject"]) == [f"in/q{n}.txt" for n in range(1, 5)]  # one each
    assert [item.name for item in items] == ["q1.txt", "q2.txt", "q3.txt", "q4.txt"]
    for item, before in zip(items, listed, strict=True):
        assert item.metadata.get("filed") == filed.get(item.name)  # in lower case, as S3 has it
        assert (item.metadata["etag"], item.metadata["last_modified"]) == (
            before.metadata["etag"],
            before.metadata["last_modified"],
        )
    shipped = pickle.loads(pickle.dumps(asked))  # as to a Ray read task: it still asks
    assert [item.metadata.get("filed") for item in shipped.documents()][:1] == ["2023-08-04"]

    # an object whose HEAD fails (deleted after its listing) is that object's error, only
    gone = S3Source(f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url, user_metadata=True)

    def delete_q2(params: dict[str, Any], **_: Any) -> None:
        if params["Key"] == "in/q2.txt":
            client.delete_object(Bucket=bucket, Key="in/q2.txt")

    gone.client.meta.events.register("before-parameter-build.s3.HeadObject", delete_q2)
    errors = {item.name: item.error for item in gone.documents()}
    assert [name for name, error in errors.items() if error] == ["q2.txt"]
    assert errors["q2.txt"].startswith(f"its user metadata: s3://{bucket}/in/q2.txt does not ")
    assert s3_server.secret_key not in errors["q2.txt"]


# --- SQL --------------------------------------------------------------------------------------

DOCS = sa.Table(
    "docs",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("title", sa.Text),
    sa.Column("body", sa.Text),
    sa.Column("content", sa.LargeBinary),
    sa.Column("author", sa.Text),
    sa.Column("published", sa.Date),
    sa.Column("questions", sa.Text),
)


def make_rows() -> list[dict[str, Any]]:
    rfc = (TEXTS / "rfc2616-http-1.1.txt").read_text() if CORPORA.is_dir() else "HTTP/1.1 " * 999
    pdf = (REPORTS / "federal-register-2020-17221.pdf").read_bytes() if CORPORA.is_dir() else b"%P"
    rows = [
        {
            "id": number,
            "title": f"doc-{number}.txt",
            "body": f"Document number {number}.",
            "content": None,
            "author": f"author {number % 2}",
            "published": date(2024, 1, number),
            "questions": json.dumps([f"What is document {number}?"]),
        }
        for number in range(1, 6)
    ]
    rows[0] |= {"body": rfc, "questions": "Who wrote it?\nWhen?"}
    rows[1] |= {"body": None, "content": pdf, "title": "register.pdf", "questions": None}
    return rows


@pytest.fixture(params=["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.server)])
def database(request: pytest.FixtureRequest) -> Iterator[str]:
    url: str = request.getfixturevalue(request.param)
    engine = sa.create_engine(url)
    DOCS.metadata.drop_all(engine)
    DOCS.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(DOCS.insert(), make_rows())
    engine.dispose()
    yield url


def test_sql_streams_rows_with_text_blob_metadata_and_questions(database: str) -> None:
    source = SqlSource(
        database,
        "SELECT id, title, body, content, author, published, questions FROM docs ORDER BY id;",
        text_column="body",
        blob_column="content",
        name_column="title",
        metadata_columns=["author", "published"],
        questions_column="questions",
        batch_size=2,
    )
    source.check()
    items = list(source.documents())
    rows = make_rows()
    assert [item.name for item in items] == [row["title"] for row in rows]
    assert [item.text for item in items] == [row["body"] for row in rows]
    assert items[1].data == rows[1]["content"] and items[1].size == len(rows[1]["content"])
    assert items[0].data is None
    assert items[0].questions == ("Who wrote it?", "When?")
    assert items[2].questions == ("What is document 3?",)
    assert items[1].questions == ()
    assert items[3].metadata == {"author": "author 0", "published": "2024-01-04"}
    # an item's URI names the database and the row, never the user or the password
    url = sa.engine.make_url(database)
    without_user = sa.engine.URL.create(
        url.drivername, host=url.host, port=url.port, database=url.database
    )
    expected_uris = [f"{without_user.render_as_string()}#{row['id']}" for row in rows]
    assert [item.uri for item in items] == expected_uris
    shipped = pickle.loads(pickle.dumps(source))
    assert [item.text for item in shipped.documents()] == [row["body"] for row in rows]


def test_sql_default_names_from_ids(database: str) -> None:
    items = list(SqlSource(database, "SELECT id, body AS text FROM docs WHERE id > 2").documents())
    assert [item.name for item in items] == ["3.txt", "4.txt", "5.txt"]


def test_sql_bad_query_and_missing_column_fail_early_without_password(database: str) -> None:
    shown = sa.engine.make_url(database).render_as_string(hide_password=True)
    with pytest.raises(SourceError, match="SQL source") as raised:
        SqlSource(database, "SELECT id, body FROM no_such_table").check()
    message = str(raised.value)
    assert message.startswith(f"SQL source {shown}: ")
    assert "no_such_table" in message and "\n" not in message
    with pytest.raises(SourceError, match="no column text"):
        SqlSource(database, "SELECT id, body FROM docs").check()
    query = "SELECT id, body AS text FROM docs"
    assert repr(SqlSource(database, query)) == f"SqlSource({shown!r}, {query!r})"


def test_sql_password_never_shows_in_repr_or_errors() -> None:
    password, port = "pw-" + uuid.uuid4().hex, free_port()  # nothing listens on the port
    source = SqlSource(f"postgresql://reader:{password}@127.0.0.1:{port}/docs", "SELECT 1")
    shown = f"postgresql+psycopg://reader:***@127.0.0.1:{port}/docs"
    assert repr(source) == f"SqlSource({shown!r}, 'SELECT 1')"
    for attempt in (source.check, lambda: list(source.documents())):
        with pytest.raises(SourceError, match="Connection refused") as raised:
            attempt()
        assert str(raised.value).startswith(f"SQL source {shown}: ")
        assert password not in str(raised.value)


def test_sql_shards_split_the_rows_once_in_the_database(database: str) -> None:
    source = SqlSource(database, "SELECT id, body, questions FROM docs", text_column="body")
    shards = source.shards(3)
    assert shards == [(0, 3), (1, 3), (2, 3)]
    sharded = [[item.uri for item in source.shard_documents(shard)] for shard in shards]
    every = [item.uri for item in source.documents()]
    assert sorted(uri for shard in sharded for uri in shard) == sorted(every)
    assert len(every) == len(make_rows()) and sum(1 for shard in sharded if shard) >= 2
    assert pickle.loads(pickle.dumps(source)).shards(3) == shards  # the same on a worker
    # the sizes come from the database (length of the text, or of the blob when it is NULL)
    rows = make_rows()
    sizes = list(SqlSource(database, "SELECT id, body, content FROM docs ORDER BY id",
                           text_column="body", blob_column="content").sizes())  # fmt: skip
    assert sizes == [len(row["body"] or row["content"]) for row in rows]


def test_sql_bad_questions_value_is_an_item_error(database: str) -> None:
    query = "SELECT id, body, CASE WHEN id = 3 THEN '[1, 2]' ELSE questions END AS q FROM docs"
    items = list(SqlSource(database, query, text_column="body", questions_column="q").documents())
    assert [item.error for item in items] == [
        None, None, "row 3: questions must be text or a list of strings", None, None
    ]  # fmt: skip


@pytest.mark.server
def test_postgres_wrong_password_fails_without_it(postgres_url: str) -> None:
    url = sa.engine.make_url(postgres_url).set(password="not-the-password-42")
    source = SqlSource(url.render_as_string(hide_password=False), "SELECT 1 AS id, 'x' AS text")
    with pytest.raises(SourceError, match="password authentication failed") as raised:
        source.check()
    assert "not-the-password-42" not in str(raised.value)


@pytest.mark.server
def test_postgres_streams_through_a_server_side_cursor(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    with engine.begin() as connection:
        connection.execute(sa.text("DROP TABLE IF EXISTS many"))
        connection.execute(
            sa.text(
                "CREATE TABLE many AS SELECT g AS id, 'row ' || g AS text "
                "FROM generate_series(1, 5000) AS g"
            )
        )
    query = "SELECT id, text FROM many ORDER BY id"
    items = SqlSource(postgres_url, query, batch_size=100).documents()
    first = next(items)
    with engine.connect() as connection:
        seen = (
            connection.execute(
                sa.text("SELECT query FROM pg_stat_activity WHERE query LIKE 'FETCH FORWARD%'")
            )
            .scalars()
            .all()
        )
    rest = list(items)
    engine.dispose()
    assert first.text == "row 1" and len(rest) == 4999
    assert seen, "the rows did not come through a server-side cursor"


@pytest.mark.server
def test_plain_postgresql_url_uses_psycopg(postgres_url: str) -> None:
    plain = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    SqlSource(plain, "SELECT 1 AS id, 'x' AS text").check()


# --- Parquet and JSON Lines -------------------------------------------------------------------

ROWS = [
    {"doc_id": 1, "body": "first text", "title": "one.txt", "lang": "en", "qs": ["Q1?", "Q2?"]},
    {"doc_id": 2, "body": "second text", "title": "two.txt", "lang": "fr", "qs": []},
    {"doc_id": 3, "body": "third text", "title": "three.txt", "lang": "de", "qs": ["Q3?"]},
]


def dataset_source(path: Path, **overrides: Any) -> DatasetSource:
    settings: dict[str, Any] = {
        "id_column": "doc_id",
        "text_column": "body",
        "name_column": "title",
        "metadata_columns": ["lang"],
        "questions_column": "qs",
        "batch_size": 2,
    }
    return DatasetSource(str(path), **(settings | overrides))


def check_rows(source: DatasetSource, path: Path) -> None:
    source.check()
    items = list(source.documents())
    assert [item.text for item in items] == [row["body"] for row in ROWS]
    assert [item.name for item in items] == [row["title"] for row in ROWS]
    assert [item.questions for item in items] == [tuple(row["qs"]) for row in ROWS]
    assert items[1].metadata == {"lang": "fr"}
    assert items[2].uri == f"{path.as_uri()}#3"


def test_parquet_rows(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    check_rows(dataset_source(path), path)


def test_jsonl_rows(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    check_rows(dataset_source(path), path)


def test_dataset_folder_of_parquet_files(tmp_path: Path) -> None:
    for number, row in enumerate(ROWS):
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / f"part-{number}.parquet")
    items = list(dataset_source(tmp_path).documents())
    assert [item.text for item in items] == [row["body"] for row in ROWS]


def test_dataset_errors(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(SourceError, match=r"docs\.jsonl:2: not valid JSON"):
        list(dataset_source(path).documents())
    with pytest.raises(SourceError, match="no column missing"):
        dataset_source(path, text_column="missing").check()
    with pytest.raises(SourceError, match="no dataset files"):
        dataset_source(tmp_path / "none.parquet").check()
    with pytest.raises(SourceError, match="unknown dataset format"):
        DatasetSource(str(path), format="csv")
    write(tmp_path / "fake.parquet", "not parquet")
    with pytest.raises(SourceError, match="not a readable Parquet file"):
        dataset_source(tmp_path / "fake.parquet").check()


def test_dataset_shards_are_row_groups_and_files(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "docs.parquet", row_group_size=1)
    (tmp_path / "more.jsonl").write_text(json.dumps({**ROWS[0], "doc_id": 9}) + "\n")
    source = dataset_source(tmp_path)
    shards = source.shards(2)
    assert shards == [(str(tmp_path / "docs.parquet"), g) for g in range(3)] + [
        (str(tmp_path / "more.jsonl"), None)
    ]
    sharded = [item for shard in shards for item in source.shard_documents(shard)]
    assert [item.uri for item in sharded] == [item.uri for item in source.documents()]
    assert [item.text for item in sharded] == [row["body"] for row in ROWS] + ["first text"]
    assert len(list(source.sizes())) == 4  # a row group's text bytes each, and the file's


def test_local_bad_sidecar_is_an_item_error(local_tree: Path) -> None:
    write(local_tree / "b.txt.questions.json", "{not json")
    items = {item.name: item for item in LocalSource([str(local_tree)]).documents()}
    assert items["b.txt"].questions == () and "not valid JSON" in (items["b.txt"].error or "")
    assert items["a.txt"].error is None and items["a.txt"].questions == ("Who?", "What?")


def test_symbolic_links_out_of_a_walked_folder_are_errors_not_reads(
    local_tree: Path, tmp_path: Path
) -> None:
    """An untrusted folder's links to files elsewhere (credentials, /etc) are refused with a
    reason; links within the folder are read; a file named itself is followed."""
    secret = write(tmp_path / "home" / ".aws" / "credentials", "aws_secret_access_key = S3CR3T")
    write(tmp_path / "home" / "notes.txt", "private notes")
    (local_tree / "creds.txt").symlink_to(secret)
    (local_tree / "sub" / "home").symlink_to(secret.parent.parent, target_is_directory=True)
    (local_tree / "again.txt").symlink_to(local_tree / "b.txt")
    (local_tree / "c.md.questions.txt").symlink_to(secret)  # a sidecar of no document
    (local_tree / "b.txt.questions.txt").symlink_to(secret)

    source = LocalSource([str(local_tree)])
    items = {item.name: item for item in source.documents()}
    assert sorted(items) == ["a.txt", "again.txt", "b.txt", "c.md", "creds.txt", "d.pdf", "home"]
    for name in ("creds.txt", "home"):
        assert f"{name} is a symbolic link that leads out of {local_tree}" in str(items[name].error)
        assert items[name].size is None
    assert "b.txt.questions.txt is a symbolic link" in str(items["b.txt"].error)
    assert items["b.txt"].questions == ()
    assert items["again.txt"].error is None
    assert source.read_bytes(items["again.txt"]) == b"bee"
    assert len(list(source.sizes())) == 5
    rows = [
        row for block in read_shard(source, 1, source.shards(1)[0]) for row in block.to_pylist()
    ]
    assert not any(b"S3CR3T" in (row["data"] or b"") for row in rows)

    pattern = LocalSource([str(local_tree / "**" / "*.txt")])
    globbed = {item.name: item for item in pattern.documents()}
    assert "symbolic link" in str(globbed["creds.txt"].error)
    # ** enters linked folders: what it finds there is refused the same way
    assert "symbolic link" in str(globbed["notes.txt"].error)
    assert globbed["again.txt"].error is None

    named = LocalSource([str(local_tree / "creds.txt")])
    assert [item.error for item in named.documents()] == [None]


def test_read_shards_carry_the_content_in_blocks_of_about_block_bytes(local_tree: Path) -> None:
    source = LocalSource([str(local_tree)])
    rows = [
        row for block in read_shard(source, 1, source.shards(4)[0]) for row in block.to_pylist()
    ]
    assert [row["data"] for row in rows] == [b"ay", b"bee", b"# sea", b"%PDF-1.4 fake"]
    big = [{**rows[0], "text": "x" * 40_000, "data": None} for _ in range(10)]
    blocks = list(blocks_of(big, block_bytes=100_000))
    assert [block.num_rows for block in blocks] == [3, 3, 3, 1]
    assert all(block.schema.equals(DOCUMENT_SCHEMA) for block in blocks)
    datasource = SourceDatasource([source, source], parallelism=4)
    assert datasource.shards == [(0, tuple(source.paths)), (1, tuple(source.paths))]
    assert len(datasource.get_read_tasks(200)) == 2


# --- open_source ------------------------------------------------------------------------------


def test_open_source_specs(tmp_path: Path, sqlite_url: str) -> None:
    write(tmp_path / "a.txt", "a")
    local = open_source(str(tmp_path))
    assert isinstance(local, LocalSource) and [i.name for i in local.documents()] == ["a.txt"]
    assert isinstance(open_source({"type": "local", "path": str(tmp_path)}), LocalSource)
    s3 = open_source({"type": "s3", "uri": "s3://bucket/prefix", "endpoint_url": "http://x:1"})
    assert isinstance(s3, S3Source) and s3.endpoint_url == "http://x:1"
    sql = open_source({"type": "sql", "url": sqlite_url, "query": "SELECT 1 AS id, 'x' AS text"})
    assert isinstance(sql, SqlSource) and [item.text for item in sql.documents()] == ["x"]
    dataset = open_source({"type": "dataset", "path": str(tmp_path / "d.jsonl"), "format": "jsonl"})
    assert isinstance(dataset, DatasetSource)
    with pytest.raises(SourceError, match="unknown source type"):
        open_source({"type": "ftp"})
    with pytest.raises(SourceError, match="unknown sql source option querry"):
        open_source({"type": "sql", "url": sqlite_url, "querry": "SELECT 1"})
    with pytest.raises(SourceError, match="for a database give"):
        open_source("postgresql://user:pw@host/db")


# --- outputs ----------------------------------------------------------------------------------

TABLE = pa.table({"doc": ["a", "b"], "answer": ["yes", "no"]})


def test_open_output_local_folder(tmp_path: Path) -> None:
    filesystem, base = open_output(str(tmp_path / "out" / "run1"))
    assert isinstance(filesystem, pafs.LocalFileSystem)
    check_output(filesystem, base)
    pq.write_table(TABLE, f"{base}/answers.parquet", filesystem=filesystem)
    found = duckdb.sql(f"SELECT doc, answer FROM '{base}/answers.parquet' ORDER BY doc").fetchall()
    assert found == [("a", "yes"), ("b", "no")]
    assert [path.name for path in (tmp_path / "out" / "run1").iterdir()] == ["answers.parquet"]
    assert open_output((tmp_path / "x").as_uri())[1] == str(tmp_path / "x")


def test_open_output_unwritable_folder(tmp_path: Path) -> None:
    write(tmp_path / "file", "a file, not a folder")
    filesystem, base = open_output(str(tmp_path / "file" / "out"))
    with pytest.raises(OutputError, match="cannot write"):
        check_output(filesystem, base)


@pytest.mark.server
def test_open_output_s3(s3_server: S3Server, bucket: str) -> None:
    filesystem, base = open_output(f"s3://{bucket}/results/run1/", s3_server.endpoint_url)
    assert isinstance(filesystem, pafs.S3FileSystem) and base == f"{bucket}/results/run1"
    check_output(filesystem, base)
    pq.write_table(TABLE, f"{base}/answers.parquet", filesystem=filesystem)
    assert pq.read_table(f"{base}/answers.parquet", filesystem=filesystem).equals(TABLE)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    # Besides the file, pyarrow may leave an empty folder marker "results/run1/" (zero bytes).
    assert [key for key in keys if not key.endswith("/")] == ["results/run1/answers.parquet"]

    filesystem, base = open_output("s3://no-such-bucket-memstream/x", s3_server.endpoint_url)
    with pytest.raises(OutputError, match="does not exist"):
        check_output(filesystem, base)


@pytest.mark.server
def test_open_output_s3_wrong_credentials(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_credential_checks(s3_server)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    filesystem, base = open_output(f"s3://{bucket}/out", s3_server.endpoint_url)
    with pytest.raises(OutputError, match="credentials") as raised:
        check_output(filesystem, base)
    assert "wrong-secret-value" not in str(raised.value)
