"""The API's page: limit and offset, bounded so that a huge value is a short page, not a
database error (SQLite and PostgreSQL take 64-bit integers at most)."""

from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 10**12  # past any real row; a larger offset gives the same empty page


class Pagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 1000

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), MAX_OFFSET)
