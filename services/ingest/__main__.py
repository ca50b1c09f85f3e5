"""``python -m services.ingest``"""

import asyncio

from services.ingest.main import main

asyncio.run(main())
