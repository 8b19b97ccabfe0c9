"""An in-process store that keeps every push request it applied, so a test can compare
what a cache sent to its store, request by request."""

from __future__ import annotations

from typing import Any

import ps
from comm import Handle


class Capturing(ps.InProcessStore):
    """The in-process store, keeping every push request it applied."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[ps.PushRequest] = []

    def push_many_async(self, requests: Any) -> Handle:
        handle = super().push_many_async(requests)
        self.requests += list(requests)
        return handle

    def push_groups_async(self, requests: Any) -> Handle:
        # A group push is cut into its tables' pushes (the base class's way), so they
        # are kept as every other push is.
        return ps.Store.push_groups_async(self, requests)
