"""The /dashboard page: static HTML + JS (index.html), served by the router."""
