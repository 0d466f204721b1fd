"""Incremental runs: a run id per run, the job and archive it belongs to, where each answer was
computed, which later run superseded an answer, and one lock per archive.

Runs made before it keep their rows: a run id then was the job's key, so `job_key` is set to it;
an answered chain was answered by the run that last planned it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("job_key", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("archive_key", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("previous_run_id", sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f("ix_runs_archive_key"), ["archive_key"], unique=False)
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.add_column(sa.Column("answered_in_run", sa.String(length=64), nullable=True))
    with op.batch_alter_table("run_chains", schema=None) as batch_op:
        batch_op.add_column(sa.Column("superseded_by", sa.String(length=64), nullable=True))
    op.create_table(
        "run_locks",
        sa.Column("lock_key", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("lock_key"),
    )
    op.execute("UPDATE runs SET job_key = run_id")
    op.execute("UPDATE chains SET answered_in_run = run_id WHERE status = 'done'")


def downgrade() -> None:
    op.drop_table("run_locks")
    with op.batch_alter_table("run_chains", schema=None) as batch_op:
        batch_op.drop_column("superseded_by")
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.drop_column("answered_in_run")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_archive_key"))
        batch_op.drop_column("previous_run_id")
        batch_op.drop_column("archive_key")
        batch_op.drop_column("job_key")
