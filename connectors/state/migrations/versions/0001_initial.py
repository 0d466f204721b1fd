"""The schema of memstream 0.1: the corpus job's and the Serve job queue's tables.

A database made before migrations existed gets the tables it lacks and is stamped with this
revision, so it upgrades in place.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # State files made before migrations existed hold some or all of these tables already.
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "chains" not in existing:
        op.create_table(
            "chains",
            sa.Column("chain_key", sa.String(length=64), nullable=False),
            sa.Column("run_id", sa.String(length=64), nullable=False),
            sa.Column("doc_id", sa.String(length=64), nullable=False),
            sa.Column("source_uri", sa.Text(), nullable=False),
            sa.Column("question_id", sa.String(length=128), nullable=False),
            sa.Column("question", sa.Text(), nullable=False),
            sa.Column("status", sa.String(length=16), nullable=False),
            sa.Column("step", sa.Integer(), nullable=False),
            sa.Column("memory", sa.Text(), nullable=True),
            sa.Column("answer", sa.Text(), nullable=True),
            sa.Column("raw_response", sa.Text(), nullable=True),
            sa.Column("n_segments", sa.Integer(), nullable=False),
            sa.Column("n_tokens", sa.Integer(), nullable=False),
            sa.Column("prompt_tokens", sa.Integer(), nullable=False),
            sa.Column("completion_tokens", sa.Integer(), nullable=False),
            sa.Column("compute_s", sa.Float(), nullable=False),
            sa.Column("error", sa.Text(), nullable=True),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("started_at", sa.Float(), nullable=True),
            sa.Column("updated_at", sa.Float(), nullable=False),
            sa.Column("finished_at", sa.Float(), nullable=True),
            sa.PrimaryKeyConstraint("chain_key"),
        )
    if "documents" not in existing:
        op.create_table(
            "documents",
            sa.Column("run_id", sa.String(length=64), nullable=False),
            sa.Column("source_uri", sa.String(length=2048), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("doc_id", sa.String(length=64), nullable=False),
            sa.Column("name", sa.Text(), nullable=False),
            sa.Column("content_sha256", sa.String(length=64), nullable=False),
            sa.Column("parser", sa.String(length=64), nullable=True),
            sa.Column("pages", sa.Integer(), nullable=True),
            sa.Column("warnings", sa.Text(), nullable=True),
            sa.Column("metadata", sa.Text(), nullable=True),
            sa.Column("n_tokens", sa.Integer(), nullable=True),
            sa.Column("n_segments", sa.Integer(), nullable=True),
            sa.Column("updated_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("run_id", "source_uri"),
        )
    if "errors" not in existing:
        op.create_table(
            "errors",
            sa.Column("run_id", sa.String(length=64), nullable=False),
            sa.Column("source_uri", sa.String(length=2048), nullable=False),
            sa.Column("stage", sa.String(length=32), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("doc_id", sa.String(length=64), nullable=True),
            sa.Column("name", sa.Text(), nullable=True),
            sa.Column("error_type", sa.String(length=128), nullable=False),
            sa.Column("message", sa.Text(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("run_id", "source_uri", "stage"),
        )
    if "groundings" not in existing:
        op.create_table(
            "groundings",
            sa.Column("chain_key", sa.String(length=64), nullable=False),
            sa.Column("grounded", sa.Boolean(), nullable=False),
            sa.Column("reason", sa.Text(), nullable=False),
            sa.Column("evidence", sa.Text(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("chain_key"),
        )
    if "rejected_quotes" not in existing:
        op.create_table(
            "rejected_quotes",
            sa.Column("chain_key", sa.String(length=64), nullable=False),
            sa.Column("step", sa.Integer(), nullable=False),
            sa.Column("quotes", sa.Text(), nullable=False),
            sa.PrimaryKeyConstraint("chain_key", "step"),
        )
    if "run_chains" not in existing:
        op.create_table(
            "run_chains",
            sa.Column("run_id", sa.String(length=64), nullable=False),
            sa.Column("source_uri", sa.String(length=2048), nullable=False),
            sa.Column("question_id", sa.String(length=128), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("chain_key", sa.String(length=64), nullable=False),
            sa.Column("question", sa.Text(), nullable=False),
            sa.Column("updated_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("run_id", "source_uri", "question_id"),
        )
        with op.batch_alter_table("run_chains", schema=None) as batch_op:
            batch_op.create_index(
                batch_op.f("ix_run_chains_chain_key"), ["chain_key"], unique=False
            )
    if "runs" not in existing:
        op.create_table(
            "runs",
            sa.Column("run_id", sa.String(length=64), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("status", sa.String(length=16), nullable=False),
            sa.Column("summary", sa.Text(), nullable=True),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("started_at", sa.Float(), nullable=False),
            sa.Column("finished_at", sa.Float(), nullable=True),
            sa.PrimaryKeyConstraint("run_id"),
        )
    if "serving_events" not in existing:
        op.create_table(
            "serving_events",
            sa.Column("event_id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("job_id", sa.String(length=32), nullable=False),
            sa.Column("kind", sa.String(length=16), nullable=False),
            sa.Column("data", sa.Text(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("event_id"),
        )
        with op.batch_alter_table("serving_events", schema=None) as batch_op:
            batch_op.create_index(batch_op.f("ix_serving_events_job_id"), ["job_id"], unique=False)
    if "serving_jobs" not in existing:
        op.create_table(
            "serving_jobs",
            sa.Column("job_id", sa.String(length=32), nullable=False),
            sa.Column("status", sa.String(length=16), nullable=False),
            sa.Column("name", sa.Text(), nullable=False),
            sa.Column("source", sa.Text(), nullable=False),
            sa.Column("uri", sa.Text(), nullable=True),
            sa.Column("input_data", sa.LargeBinary(), nullable=True),
            sa.Column("mime_type", sa.String(length=255), nullable=True),
            sa.Column("questions", sa.Text(), nullable=False),
            sa.Column("method", sa.Text(), nullable=False),
            sa.Column("text", sa.Text(), nullable=True),
            sa.Column("document", sa.Text(), nullable=True),
            sa.Column("error", sa.Text(), nullable=True),
            sa.Column("owner", sa.String(length=64), nullable=True),
            sa.Column("lease_expires_at", sa.Float(), nullable=True),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("started_at", sa.Float(), nullable=True),
            sa.Column("updated_at", sa.Float(), nullable=False),
            sa.Column("finished_at", sa.Float(), nullable=True),
            sa.PrimaryKeyConstraint("job_id"),
        )
        with op.batch_alter_table("serving_jobs", schema=None) as batch_op:
            batch_op.create_index(batch_op.f("ix_serving_jobs_status"), ["status"], unique=False)
    if "steps" not in existing:
        op.create_table(
            "steps",
            sa.Column("chain_key", sa.String(length=64), nullable=False),
            sa.Column("step", sa.Integer(), nullable=False),
            sa.Column("kind", sa.String(length=16), nullable=False),
            sa.Column("segment_index", sa.Integer(), nullable=True),
            sa.Column("token_start", sa.Integer(), nullable=True),
            sa.Column("token_end", sa.Integer(), nullable=True),
            sa.Column("char_start", sa.Integer(), nullable=True),
            sa.Column("char_end", sa.Integer(), nullable=True),
            sa.Column("memory_after", sa.Text(), nullable=False),
            sa.Column("prompt_tokens", sa.Integer(), nullable=False),
            sa.Column("completion_tokens", sa.Integer(), nullable=False),
            sa.Column("finish_reason", sa.String(length=32), nullable=True),
            sa.Column("latency_s", sa.Float(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("chain_key", "step"),
        )


def downgrade() -> None:
    op.drop_table("steps")
    with op.batch_alter_table("serving_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_serving_jobs_status"))

    op.drop_table("serving_jobs")
    with op.batch_alter_table("serving_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_serving_events_job_id"))

    op.drop_table("serving_events")
    op.drop_table("runs")
    with op.batch_alter_table("run_chains", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_chains_chain_key"))

    op.drop_table("run_chains")
    op.drop_table("rejected_quotes")
    op.drop_table("groundings")
    op.drop_table("errors")
    op.drop_table("documents")
    op.drop_table("chains")
