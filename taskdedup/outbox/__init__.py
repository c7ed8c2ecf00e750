"""The transactional outbox, framework-free core (SPEC §14) — BEING BUILT.

Brief for the helpers building it (the sections SHARED_DESIGN and COMMON_RULES referred to
in the briefs): read DESIGN.md beside this file and follow it; delete DESIGN.md when done.
"""
