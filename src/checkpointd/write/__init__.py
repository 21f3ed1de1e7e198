"""The writer: from ``save()`` to a durable checkpoint. Front ends, handle and
lifecycle, the background loop, capture and staging, the plan (what a save writes),
the commit (how it becomes durable, alone or from many ranks), incremental saves, preemption."""
