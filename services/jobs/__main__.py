"""``python -m services.jobs``"""

import asyncio

from services.jobs.main import main

asyncio.run(main())
